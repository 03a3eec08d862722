"""The recovered run's loss curve drawn over the uninterrupted run's, with plotly."""

from __future__ import annotations

from typing import Any

__all__ = ["recovery_figure"]


def recovery_figure(
    reference: dict[int, float],
    recovered: dict[int, float],
    *,
    killed_at: int | None = None,
    restored_step: int | None = None,
    restored_tier: str | None = None,
    title: str = "A rank killed, the group restarted, the run finished: same curve",
) -> Any:
    """A plotly figure: the uninterrupted curve as a wide band, the recovered one over it.

    Args:
        reference: Loss by step of the uninterrupted run.
        recovered: Loss by step of the killed-and-recovered run.
        killed_at: Step after which a rank was killed (a red line).
        restored_step: Step of the checkpoint the restart loaded (a green line).
        restored_tier: Where it came from (``"memory"`` or ``"volume"``), for its label.
        title: Figure title.
    """
    import plotly.graph_objects as go  # noqa: TID251 - figures are the front end's job

    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=list(reference),
            y=list(reference.values()),
            name="uninterrupted run",
            mode="lines",
            line={"color": "rgba(99,110,250,0.35)", "width": 10},
        )
    )
    fig.add_trace(
        go.Scatter(
            x=list(recovered),
            y=list(recovered.values()),
            name="killed and recovered run",
            mode="lines+markers",
            line={"color": "#EF553B", "width": 2},
            marker={"size": 5},
        )
    )

    # Three labels at three heights, so none covers another: the kill's at the top right
    # of its line, the re-run steps' under it, the restore's at the bottom left of its line
    # (where the falling loss curves leave the plot empty).
    def label(x: float, y: float, text: str, color: str, side: str) -> None:
        fig.add_annotation(
            x=x,
            xref="x",
            y=y,
            yref="paper",
            text=text,
            showarrow=False,
            xanchor=side,
            yanchor="top" if y > 0.5 else "bottom",
            xshift=5 if side == "left" else -5,
            font={"color": color, "size": 12},
            bgcolor="rgba(255,255,255,0.85)",
        )

    if killed_at is not None and restored_step is not None and killed_at > restored_step:
        again = killed_at - restored_step
        fig.add_vrect(
            x0=restored_step + 0.5,
            x1=killed_at + 0.5,
            fillcolor="#FFA15A",
            opacity=0.15,
            line_width=0,
        )
        label(
            killed_at + 0.5,
            0.86,
            f"{again} step{'s' * (again != 1)} trained again after the restore",
            "#c2410c",
            "left",
        )
    if killed_at is not None:
        fig.add_vline(x=killed_at, line={"color": "#d62728", "dash": "dash"})
        label(killed_at, 0.99, f"rank SIGKILLed after step {killed_at}", "#d62728", "left")
    if restored_step is not None:
        fig.add_vline(x=restored_step, line={"color": "#2ca02c", "dash": "dot"})
        where = f" from {restored_tier}" if restored_tier else ""
        label(restored_step, 0.02, f"restored step {restored_step}{where}", "#15803d", "right")
    fig.update_layout(
        title=title,
        xaxis_title="step",
        yaxis_title="training loss (mean over ranks)",
        template="plotly_white",
        width=900,
        height=450,
        legend={"x": 0.99, "xanchor": "right", "y": 0.75},
    )
    return fig
