"""JupyterLab as ``make lab`` serves it (the Makefile puts this folder on JUPYTER_CONFIG_PATH).

A user's own Jupyter configuration (``~/.jupyter``) still applies and wins over this file;
``labconfig/page_config.json`` beside it turns off the news and update pop-up
(``@jupyterlab/apputils-extension:announcements``).

Notebooks open unmodified. On opening, JupyterLab writes the running kernel's
``kernelspec`` and ``language_info`` (Python's exact version included) into the notebook's
metadata; where they differ from what the file stores, the notebook is marked modified
before the student typed anything, and autosave rewrites the file. No stored value can
match every Python, so the contents manager below fills that metadata in as the notebook is
read, from this server's own ``python3`` kernel: JupyterLab then finds nothing to change.
The file on disk is untouched until the student saves it.

Kernels start with labkit's OpenMP setting (``GOMP_SPINCOUNT``, ``labkit/openmp.py``) in their
environment, whatever a notebook imports first: ``import labkit`` below sets it in this
server's environment (unless the user chose ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT``), and a
kernel inherits the environment of the server that starts it.

Kernels talk to the server over ZeroMQ on loopback, encrypted with CurveZMQ keys the server
provisions where the kernel says it supports them (ipykernel 7 does). Otherwise each kernel
would warn, in this terminal, that it is "running over TCP without encryption", on every
notebook opened.
"""

import labkit  # noqa: F401  (sets GOMP_SPINCOUNT for the kernels: see above)
from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager


class KernelMatchingContentsManager(AsyncLargeFileManager):
    """Reads ``python3`` notebooks with the metadata this server's python3 kernel reports."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model.get("type") == "notebook" and model.get("content") is not None:
            self._match_kernel(model["content"].metadata)
        return model

    def _match_kernel(self, metadata) -> None:
        spec = metadata.get("kernelspec") or {}
        if spec.get("name", "python3") != "python3":
            return                      # another kernel: JupyterLab's own business
        try:
            from ipykernel.ipkernel import IPythonKernel
            installed = self.parent.kernel_spec_manager.get_kernel_spec("python3")
        except Exception:               # no ipykernel or no python3 kernel here: leave it be
            return
        metadata["kernelspec"] = {"name": "python3", "display_name": installed.display_name,
                                  "language": installed.language}
        metadata["language_info"] = dict(IPythonKernel.language_info)


c.ServerApp.contents_manager_class = KernelMatchingContentsManager  # noqa: F821 (traitlets' config object)


def _curve_available() -> bool:
    """Whether this jupyter_server can provision CurveZMQ keys (2.18+) and pyzmq can use them."""
    import zmq
    from jupyter_server.services.kernels.kernelmanager import MappingKernelManager
    return zmq.has("curve") and "transport_encryption" in MappingKernelManager.class_traits()


if _curve_available():
    c.MappingKernelManager.transport_encryption = "auto"  # noqa: F821
