"""How the profile writes a figure in text: the terminal report, the notes and the plot.

A *figure* is ``{"value", "interval"}`` (``intervals.Bootstrap.figure``); ``value`` None is
"no value" (written ``-``), ``interval`` None is "no interval", and an interval's end None
is +inf (a cost ratio whose denominator was not resolved above zero).
"""

__all__ = ["num", "val", "interval", "fig", "pct", "ratio"]


def num(v, digits=1):
    """``v`` with ``digits`` decimals (thousands grouped, no decimals, from 1000); ``-`` for
    None."""
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def val(v, unit, digits=1):
    """``v unit``, or ``-`` (no unit) when there is no value."""
    return "-" if v is None else f"{num(v, digits)} {unit}"


def _end(v, digits, sign):
    if v is None:
        return "inf"
    return f"{v:+.{digits}f}" if sign else num(v, digits)


def interval(bounds, unit, digits=1, sign=False):
    """``[low, high] unit``; ``[low, inf) unit`` when unbounded above; ``[no interval]``."""
    if bounds is None:
        return "[no interval]"
    low, high = bounds
    close = ")" if high is None else "]"
    return f"[{_end(low, digits, sign)}, {_end(high, digits, sign)}{close} {unit}"


def fig(figure, unit, digits=1, sign=False):
    """``value unit [low, high]`` of a figure; ``-`` without a value."""
    if figure is None or figure["value"] is None:
        return "-"
    v = figure["value"]
    text = f"{v:+.{digits}f}" if sign else num(v, digits)
    i = figure["interval"]
    if i is None:
        return f"{text} {unit} [no interval]"
    close = ")" if i[1] is None else "]"
    return f"{text} {unit} [{_end(i[0], digits, sign)}, {_end(i[1], digits, sign)}{close}"


def ratio(figure, digits=1):
    """A cost ratio: ``12.3 x [4.5, 20.1]``; ``>= 4.5 x [4.5, inf)`` when the point
    estimate is unbounded (the mode's own cost not above zero); ``unbounded: no cost``
    when every resample is; ``-`` without a value or an interval."""
    if figure is None:
        return "-"
    i = figure["interval"]
    if figure["value"] is None:
        if i is None:
            return "-"
        if i[0] is None:
            return "unbounded: no cost"
        return f">= {num(i[0], digits)} x [{num(i[0], digits)}, inf)"
    return fig(figure, "x", digits)


def pct(share):
    """A share in 0..1 as a whole percentage; ``-`` for None."""
    return "-" if share is None else f"{100 * share:.0f} %"
