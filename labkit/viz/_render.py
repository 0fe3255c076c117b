"""Showing a figure that changes, in JupyterLab 4 (ipywidgets 8) and in Colab (ipywidgets 7).

``FigureView`` puts a plotly figure dict on screen and replaces it when asked. Where a
``FigureWidget`` works (plotly >= 6 needs ``anywidget``) only what changed travels to the
browser and the view does not flicker; elsewhere (Colab, no anywidget) the figure is
re-rendered as a plain ``go.Figure`` inside an ``ipywidgets.Output``, which every
frontend shows. Both paths take the same dicts from the pure figure-data functions.
"""

from __future__ import annotations

import copy

from . import _deps


class FigureView:
    """A slot on screen for a plotly figure dict; ``show(fig_dict)`` replaces its content.

    ``figure_widget``: True forces a ``FigureWidget`` (error if impossible), False forces
    the ``Output`` fallback, None picks the first that works here.
    """

    def __init__(self, fig_dict: dict, figure_widget: bool | None = None):
        self.figure_dict = fig_dict
        self.figure = None
        if figure_widget is not False:
            self.figure = _deps.figure_widget_or_none(fig_dict)
            if self.figure is None and figure_widget:
                raise RuntimeError("plotly's FigureWidget is not available here (plotly >= 6 needs "
                                   "anywidget: pip install anywidget); use figure_widget=None")
        if self.figure is not None:
            self.widget = self.figure
        else:
            self.widget = _deps.widgets().Output()
            self._render()

    @property
    def uses_figure_widget(self) -> bool:
        return self.figure is not None

    def show(self, fig_dict: dict) -> None:
        self.figure_dict = fig_dict
        if self.figure is None:
            self._render()
            return
        fw = self.figure
        with fw.batch_update():
            for trace, new in zip(fw.data, fig_dict["data"]):
                trace.update({k: v for k, v in new.items() if k != "type"}, overwrite=True)
            fw.layout.update(fig_dict["layout"], overwrite=True)
        self._resync()

    def _resync(self) -> None:
        """Copy the figure into the state a new view starts from (plotly >= 6).

        A ``FigureWidget`` sends edits as deltas to the views that exist, and refreshes the
        state that *new* views start from only when it is displayed by itself. Inside a
        container (our VBox) that never happens, and a view created after a few edits
        starts from a corrupted copy (plotly.js fails in ``cleanData``). Refreshing it after
        every edit is what ``FigureWidget._repr_mimebundle_`` does before a display.
        """
        fw = self.figure
        if hasattr(fw, "_widget_data") and hasattr(fw, "_layout_obj"):
            fw._widget_layout = copy.deepcopy(fw._layout_obj._props)
            fw._widget_data = copy.deepcopy(fw._data)

    def _render(self) -> None:
        from IPython import get_ipython
        from IPython.display import clear_output, display
        if get_ipython() is None:      # not in a notebook (scripts, tests): nothing to draw into
            return
        fig = _deps.go().Figure(self.figure_dict)
        with self.widget:
            clear_output(wait=True)
            display(fig)
