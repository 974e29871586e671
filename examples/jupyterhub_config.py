# gpulease under JupyterHub: add this to jupyterhub_config.py (or load it from there with
# load_subconfig("gpulease_jupyterhub_config.py")). Every single-user server and its kernels then act
# for their Hub user towards the lease server, with one shared proxy token. Make that token once:
#     gpulease token create hub --proxy --acts-for '*'     (or --acts-for 'alice,bob', 'lab-*')
# and start the Hub with GPULEASE_URL and GPULEASE_TOKEN (the proxy token) in its environment.
import os

c = get_config()  # noqa: F821 - JupyterHub's config loader provides get_config

c.Spawner.environment.update(
    {
        "GPULEASE_URL": os.environ["GPULEASE_URL"],  # the lease server, e.g. http://leases.example:8470
        "GPULEASE_TOKEN": os.environ["GPULEASE_TOKEN"],  # the proxy token
        # Whom the token acts for: the Hub user, for the GPU board (the server extension) and for
        # %%gpu_train in the user's kernels. Hub user names must be lease user names (letters,
        # digits, '.', '_', '-'): map others here, e.g. spawner.user.name.replace("@", "_at_").
        "GPULEASE_USER": lambda spawner: spawner.user.name,
    }
)
