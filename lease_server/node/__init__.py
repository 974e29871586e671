"""The node side: the node agent, ending processes and draining, the embedded Redis server, the
kernelspec, Ray's auth."""
