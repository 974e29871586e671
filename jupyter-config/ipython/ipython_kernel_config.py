# Installed by gpulease into <venv>/etc/ipython: every kernel of this environment answers a
# %%gpu_train that it cannot run (a kernel other than "Python 3 (gpulease)") with the next step,
# instead of IPython's bare "Cell magic `%%gpu_train` not found". The gpulease kernel's own magics
# replace the hint when they load (magics/hint.py).
c = get_config()  # noqa: F821 (traitlets' config file namespace)
c.InteractiveShellApp.extensions.append("magics.hint")
