"""Optional dependencies of the widgets, imported only when a figure or widget is built.

``import labkit.viz`` must stay light (the engine and the tests import labkit without the
lab extras), so plotly and ipywidgets are imported here, on first use, with an error that
says how to get them.
"""

from __future__ import annotations

import importlib
import sys

_HINT = "labkit.viz needs {what}: pip install 'labkit[lab]'  (or: pip install {pkg})"


def _require(module: str, what: str, pkg: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(_HINT.format(what=what, pkg=pkg)) from e


def go():
    """``plotly.graph_objects``."""
    return _require("plotly.graph_objects", "plotly for its figures", "plotly")


def widgets():
    """``ipywidgets`` (7.x on Colab, 8.x in JupyterLab 4: only the API common to both is used)."""
    return _require("ipywidgets", "ipywidgets for its live widgets", "ipywidgets")


def in_colab() -> bool:
    """Whether we run in Google Colab (its widget manager and plotly renderer differ)."""
    return "google.colab" in sys.modules


def figure_widget_or_none(figure_dict: dict):
    """A ``plotly.graph_objects.FigureWidget`` of ``figure_dict``, or None where it cannot work.

    FigureWidget is the smooth way to update a live figure (only the changes travel to the
    browser), but plotly >= 6 builds it on ``anywidget``, and on Colab (ipywidgets 7) it is
    not dependable. Callers fall back to re-rendering a plain ``go.Figure`` in an
    ``ipywidgets.Output`` when this returns None.
    """
    if in_colab():
        return None
    try:
        return go().FigureWidget(figure_dict)
    except Exception:       # ImportError (no anywidget), or a frontend-less environment
        return None
