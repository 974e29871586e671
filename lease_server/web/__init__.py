"""The HTTP face: handlers, the OpenAPI document, tokens, metrics, the server process."""
