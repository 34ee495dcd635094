"""What ``kvbench sweep --dry-run`` says about each cell, and the checks it makes before anything runs.

Per cell: the accuracy suites it runs (``[accuracy: gsm8k, ruler]``), whether it runs the load test
(``[load]``) and whether it is the A/A control (``[A/A]``), as ``harness/runner.py`` decides them.
"""

from __future__ import annotations

from kvbench.harness.errors import UserError


def cell_work(sweep, cell) -> list[str]:
    """The tags of one cell: ``accuracy: <suites>``, ``load``, ``A/A``; ``nothing to run`` when none apply."""
    tags = []
    if cell.run_accuracy and sweep.suites:
        tags.append("accuracy: " + ", ".join(s.name for s in sweep.suites))
    if sweep.load.enabled and cell.run_load and not cell.config.get("aa_control"):
        tags.append("load")
    if cell.config.get("aa_control"):
        tags.append("A/A")
    return tags or ["nothing to run"]


def cell_line(sweep, cell) -> str:
    """``<key>  <label>  [accuracy: gsm8k] [load]``: one line of the dry-run listing."""
    return f"{cell.key}  {cell.label}  " + " ".join(f"[{t}]" for t in cell_work(sweep, cell))


def check_models(sweep, cells) -> None:
    """Every model a cell loads here (embedded and server targets) must be one ``--model`` can take:
    ``harness/model_input.check_model_ref`` (a path that names nothing is refused; hub ids pass).  Endpoint
    targets serve their own model and are not checked.  Raises ``UserError`` naming the model."""
    from kvbench.harness.model_input import check_model_ref

    seen: set[str] = set()
    for c in cells:
        model = c.config.get("model")
        if model in seen or sweep.target(c.config["target"]).type == "endpoint":
            continue
        seen.add(model)
        try:
            check_model_ref(model)
        except UserError as e:
            raise UserError(f"model: {e}") from None
