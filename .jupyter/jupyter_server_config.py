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

The terminal shows nothing a student should not act on:

* Kernels talk to the server over ZeroMQ on loopback, encrypted with CurveZMQ keys the server
  provisions where the kernel says it supports them (ipykernel 7 does). Otherwise each kernel
  warns, in this terminal, that it is "running over TCP without encryption", on every
  notebook opened.
* jupyter_server gives its websocket keep-alive in milliseconds (30000, timeout 90000) where
  tornado 6.5+ reads seconds, and tornado warns, at the first notebook opened, that the
  timeout is longer than the interval, then clamps it (jupyter-server/jupyter_server#1612).
  Setting the two equal would not do: jupyter_server's own timer would then close a
  websocket whose pong arrived a moment late. That one message is filtered out; nothing else
  changes.
"""

import logging

import labkit  # noqa: F401  (sets GOMP_SPINCOUNT for the kernels: see above)
from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager


class KernelMatchingContentsManager(AsyncLargeFileManager):
    """Reads ``python3`` notebooks with the metadata this server's python3 kernel reports,
    and output-less notebooks as trusted (nothing in them to distrust)."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model.get("type") == "notebook" and model.get("content") is not None:
            self._match_kernel(model["content"].metadata)
        return model

    def mark_trusted_cells(self, nb, path="") -> None:
        """A notebook without rich output (the lab's, as committed) has nothing to trust: its
        cells are trusted, as nbformat's ``check_cells`` trusts them when a notebook is saved,
        instead of a "Notebook ... is not trusted" warning in the terminal at every opening.
        A ``trusted`` flag stored in the file is never a reason; anything else (rich output
        without a valid signature) goes through Jupyter's own rule, warning included."""
        for cell in nb.get("cells", []):
            cell.get("metadata", {}).pop("trusted", None)
        if self.notary.check_cells(nb):
            self.notary.mark_cells(nb, True)
        else:
            super().mark_trusted_cells(nb, path)

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
    """Whether this jupyter_server can provision CurveZMQ keys and pyzmq can use them."""
    import zmq
    from jupyter_server.services.kernels.kernelmanager import MappingKernelManager
    return zmq.has("curve") and "transport_encryption" in MappingKernelManager.class_traits()


if _curve_available():
    c.MappingKernelManager.transport_encryption = "auto"  # noqa: F821


class _PingUnitsMismatch(logging.Filter):
    """Drops tornado's one warning about jupyter_server's websocket ping units (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("The websocket_ping_timeout (")


logging.getLogger("tornado.general").addFilter(_PingUnitsMismatch())
