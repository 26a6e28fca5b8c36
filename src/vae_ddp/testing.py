"""DDP checked in your own test suite: a test that fails, naming the cause, the day a DDP difference comes back.

    from vae_ddp.testing import assert_ddp_matches_one_device

    def test_ddp_trains_one_devices_model():
        assert_ddp_matches_one_device(MyModule, MyDataModule, data_args={"batch_size": 32})

It runs [`vae_ddp.audit.api.audit`][vae_ddp.audit.api.audit], the engine of ``vae-ddp audit``
(CPU and gloo by default, so it runs in any CI), and passes exactly when the command would exit 0
for the same model and options ([`exit_rule`][vae_ddp.audit.exit_rule]): DDP, as you run it,
trains one device's model.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from vae_ddp.audit.spec import DEFAULT_STEPS

__all__ = ["assert_ddp_matches_one_device", "failure_message"]


def assert_ddp_matches_one_device(model: Any, datamodule: Any, *, devices: int = 2, steps: int = DEFAULT_STEPS,
                                  out: Optional[Union[str, os.PathLike]] = None, **options: Any) -> Any:
    """Assert that Lightning DDP on ``devices`` processes trains ``model``'s one-device model.

    Args:
        model: your ``LightningModule`` class (init arguments in ``model_args={...}``) or an instance,
            which travels to the runs pickled, as Lightning's spawn launcher sends it: every run starts
            from a copy, with its weights (see [`audit`][vae_ddp.audit.api.audit]).
        datamodule: your ``LightningDataModule`` class (``data_args={...}``; its ``batch_size`` is the
            global batch) or such an instance.
        devices: the DDP world size (at least 2).
        steps: optimizer steps per run.
        out: the audit's output folder (``audit.json``, ``tables.md``); None: a new temporary folder
            per call, removed after it (parallel tests never share one).
        **options: [`audit`][vae_ddp.audit.api.audit]'s other arguments (``model_args``, ``data_args``,
            ``dtype``, ``precision``, ``accelerator``, ``seed``, ``effect_batches``) and any ``Trainer``
            argument (``gradient_clip_val=1.0``).

    Returns:
        The [`AuditResult`][vae_ddp.audit.api.AuditResult] (``exit_code`` 0).

    Raises:
        AssertionError: the audit's exit code is 1; the message is
            [`failure_message`][vae_ddp.testing.failure_message]: each cause with its effect, fix and page.
        TypeError, ValueError: bad input, before any training (the message names the argument; for a
            keyword neither the helper's, audit's nor Trainer's, the closest of them).
        vae_ddp.audit.api.AuditRunFailed: a training run failed: no verdict.
    """
    __tracebackhide__ = True  # pytest shows the assertion, not this frame
    from vae_ddp.audit.api import KEYWORDS, audit
    from vae_ddp.audit.argv import keywords, unexpected_keywords

    unexpected_keywords("assert_ddp_matches_one_device", options, keywords(assert_ddp_matches_one_device) + KEYWORDS)
    result = audit(model, datamodule, devices=devices, steps=steps, out=out, **options)
    if result.exit_code != 0:
        raise AssertionError(failure_message(result))
    return result


def failure_message(result: Any) -> str:
    """The assertion's message for an [`AuditResult`][vae_ddp.audit.api.AuditResult] that did not pass:
    one line of verdict, then per exposed factor (those that change what DDP trains first) its
    evidence, what it changes (the effect), its fix and its page, then any other reason; where the cause is
    not one of the known factors, the command's line naming the parameters and buffers that differ most."""
    from vae_ddp.audit.effects import CHANGES
    from vae_ddp.fixes.factor import page_url

    model = result.to_dict().get("model_name", "the model")
    causes = [f for f in result.findings if f.mechanism == "another model"]
    others = [f for f in result.findings if f.mechanism != "another model"]
    lines = [f"DDP on {result.devices} devices does not train one device's model ({model}, {result.steps} steps, "
             f"{result.dtype}): vae-ddp audit exits {result.exit_code} because of "
             f"{', '.join(result.exit_why) or 'its verdict'}"]
    for f in causes + others:
        role = ("its mechanism changes the model DDP trains" if f in causes
                else "seen; it does not change the model DDP trains")
        lines.append(f"- {f.name} ({role}): {f.evidence}")
        if f.effect is not None:
            e = f.effect
            lines.append(f"  effect: {CHANGES.get(e.kind, e.kind)} over {e.rows} global batches: bias {e.bias:.2g} "
                         f"[{e.bias_ci[0]:.2g}, {e.bias_ci[1]:.2g}] sd, noise ratio {e.variance_ratio:.2g} "
                         f"[{e.variance_ratio_ci[0]:.2g}, {e.variance_ratio_ci[1]:.2g}], on the {e.quantity}")
        if f.fix:
            lines.append(f"  fix: {f.fix}")
        lines.append(f"  page: {page_url(f.page)}")
    rest = [why for why in result.exit_why if why not in {f.factor for f in causes}]
    lines += [f"- {why}" for why in rest]
    raw = result.to_dict()
    if raw.get("unexplained"):  # the command's line: which parameters and buffers differ most, where it is localised
        from vae_ddp.audit.render import verdict_line
        from vae_ddp.audit.verdict import Verdict

        lines.append(verdict_line(Verdict.from_dict(raw)))
    if not result.deterministic:
        lines.append("  (one device's own step is not a function of the weights and the batch: see the report)")
    if result.out is not None:
        lines.append(f"report: {result.out / 'tables.md'}")
    return "\n".join(lines)
