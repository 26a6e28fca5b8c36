"""The answer to #6789 (vae_ddp.studies.answer): the bug-or-expected rule and the KL's words on made-up
results, the documented sources in the installed code, the reporter's command, and the first screen
traced number by number to the committed JSON."""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import re

import pytest
from helpers import ROOT, load_script
from test_is_it_a_bug import EXACT, QS, RS, SAME, UNRESOLVED, _effect, _part, _rs, _seeds

pytestmark = pytest.mark.timeout(120)

DIFFERENT = _part("different", ratio=3.1, ratio_ci=(1.9, 5.0))
FIXED_OK = _seeds(dict.fromkeys(QS, "equivalent"))


def _results():
    from vae_ddp.studies.verdict import load

    return load(ROOT)


def test_expected_behaviour_only_where_every_change_gives_one_devices_step_and_each_default_is_documented():
    from vae_ddp.studies.answer import DOCUMENTED, bug_or_expected

    assert bug_or_expected(RS, FIXED_OK)["kind"] == "expected"
    # with every change on, the step still differs: a bug
    rs = copy.deepcopy(RS)
    rs["variants"]["ddp, every fix"]["effect"] = _effect(DIFFERENT)
    assert bug_or_expected(rs, FIXED_OK)["kind"] == "bug"
    # whole trainings with every change on end elsewhere: a bug
    assert bug_or_expected(RS, _seeds(dict.fromkeys(QS, "equivalent"), dict.fromkeys(QS, "different")))["kind"] == "bug"
    # a difference no documented behaviour explains: a bug, named
    undocumented = {k: v for k, v in DOCUMENTED.items() if k != "noise"}
    v = bug_or_expected(RS, FIXED_OK, documented=undocumented)
    assert v["kind"] == "bug" and v["undocumented"] == ["noise"], v
    # a default that changes nothing needs no documentation
    quiet = _rs(noise=_effect(EXACT, EXACT, EXACT), batchnorm=_effect(SAME, SAME, SAME), sampler=_effect(SAME))
    assert bug_or_expected(quiet, FIXED_OK, documented=undocumented)["kind"] == "expected"
    # the step with every change not resolved, not measured, or only the same distribution: not decided
    for floor in (_effect(UNRESOLVED), None, _effect(SAME, SAME, SAME)):
        rs = copy.deepcopy(RS)
        if floor is None:
            del rs["variants"]["ddp, every fix"]
        else:
            rs["variants"]["ddp, every fix"]["effect"] = floor
        assert bug_or_expected(rs, FIXED_OK)["kind"] == "not decided", floor
    assert bug_or_expected(None)["kind"] == "not decided"


def _lh(word: str) -> dict:
    c = {"diff": 0.001, "margin": 0.01, "verdict": word}
    return {"settings": {"steps": 2000, "global_batch_size": 16, "model": "small", "seeds": list(range(10))},
            "num_seeds": 10, "comparison": {q: dict(c) for q in QS}}


def _kl_seeds(word: str) -> dict:
    s = _seeds({**dict.fromkeys(QS, "equivalent"), "train_kl": word, "val_kl": word})
    s["summary"]["ddp"]["train_kl"] = {"vs_single": {"diff": -0.0004, "margin": 0.0012}}
    return s


def test_the_kl_is_worded_by_each_study_and_inconclusive_never_matches():
    from vae_ddp.studies.answer import _kl_lh, _kl_seeds as words_seeds, kl_words

    for word, said in (("equivalent", "within one seed-to-seed standard deviation"), ("inconclusive", "is not decided"),
                       ("different", "differs from one device's")):
        k = kl_words(_kl_seeds(word), _lh(word))
        assert k["seeds"]["word"] == k["long_horizon"]["word"] == word
        text = words_seeds(k["seeds"]) + _kl_lh(k["long_horizon"])
        assert said in text and f"({word}:" in text, text
        assert "match" not in text, text  # "equivalent" is within a margin, never "matches"
    # one quantity inconclusive makes the study's KL word inconclusive
    s = _kl_seeds("equivalent")
    s["verdict"]["ddp"]["val_kl"] = "inconclusive"
    assert kl_words(s, None)["seeds"]["word"] == "inconclusive" and "long_horizon" not in kl_words(s, None)


@pytest.mark.parametrize("key", ["batchnorm", "noise", "logging", "sampler"])
def test_each_documented_behaviour_is_in_the_installed_source_it_cites(key):
    """The text each default cites is in the installed Lightning module it names (the version this
    project runs); the link names a page of Lightning's or PyTorch's."""
    from vae_ddp.studies.answer import DOCUMENTED

    label, url, module, text = DOCUMENTED[key].source
    assert text in inspect.getsource(importlib.import_module(module)), (module, text)
    assert url.startswith(("https://pytorch.org/docs/", "https://lightning.ai/docs/",
                           "https://github.com/Lightning-AI/pytorch-lightning/")), url
    assert DOCUMENTED[key].package == DOCUMENTED[key].change.startswith(("this package", "`Trainer(use_distributed"))


def test_the_reporters_command_builds(cifar_dir, monkeypatch):
    """The command for the report's setting (full CIFAR-10, 2 GPUs, every change) builds its model, data
    module and Trainer as shown (``gpu`` read as ``cpu``, ``DIR`` a folder; no download, no training), and
    every change is on."""
    from vae_ddp.fixes import GlobalBatchNoise
    from vae_ddp.studies.answer import REPORT_COMMAND, command_block

    monkeypatch.delenv("VAE_DDP_CIFAR_SUBSET", raising=False)
    vae = load_script("examples/vae.py")
    args = REPORT_COMMAND[REPORT_COMMAND.index("fit") + 1:]
    args = [str(cifar_dir) if a == "DIR" else "cpu" if a == "gpu" else a for a in args]
    cli = vae.ReportCLI(vae.VAE, subclass_mode_data=True, run=False, args=args)
    assert type(cli.datamodule).__name__ == "CIFAR10DataModule" and cli.datamodule.sampler == "global"
    assert cli.model.hparams.sync_dist_logging is True
    assert any(isinstance(c, GlobalBatchNoise) for c in cli.trainer.callbacks)
    assert cli.trainer.num_devices == 2
    from pytorch_lightning.plugins import TorchSyncBatchNorm

    assert isinstance(cli.trainer._accelerator_connector._layer_sync, TorchSyncBatchNorm)
    assert cli.trainer._accelerator_connector.use_distributed_sampler is False
    block = command_block()
    assert block.startswith("```bash") and all(a in block for a in REPORT_COMMAND)


#: Numbers that are names, not measurements: ResNet-18, CIFAR-10, #6789, Lightning versions, float32.
_NAMES = re.compile(r"ResNet-18|CIFAR-10|#6789|issues/6789|Lightning \d+(\.\d+)+|\b1\.2\.6\b|float\d+|factors/\w+"
                    r"|\[\d+\]")
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def _leaves(obj) -> list[float]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in _leaves(v)]
    return [float(obj)] if isinstance(obj, (int, float)) and not isinstance(obj, bool) else []


def _shown(token: str, values: list[float]) -> bool:
    """Whether ``token`` (as printed, e.g. ``0.597``, ``-6.2e-05``, ``2,000``) is one of ``values`` at
    its printed precision."""
    t = token.replace(",", "")
    mant = t.split("e")[0]
    digits = len(mant.split(".")[1]) if "." in mant else 0
    exp = int(t.split("e")[1]) if "e" in t else 0
    step = 10.0 ** (exp - digits)
    x = float(t)
    return any(abs(v - x) <= step / 2 * 1.0001 or abs(abs(v) - abs(x)) <= step / 2 * 1.0001 for v in values)


def test_every_number_on_the_first_screen_is_in_the_committed_json():
    """Home's box: each number is a value of the committed studies' JSON, at the precision printed
    (the per-device batch, global batch / world size, included); none is typed."""
    from vae_ddp.studies.answer import first_screen

    results = _results()
    values = _leaves(results)
    s = results["report_scale"]["settings"]
    values.append(s["global_batch_size"] / s["world_size"])
    from vae_ddp.harness.effect import CONFIDENCE

    values.append(100 * CONFIDENCE)  # "95% interval": the intervals' stated confidence
    values += [100 * v for v in list(values)]  # a share written as a percentage
    box = first_screen(results)
    text = _NAMES.sub(" ", box)
    tokens = _NUMBER.findall(text)
    assert len(tokens) >= 15, tokens
    missing = [t for t in tokens if not _shown(t, values)]
    assert not missing, missing
    # the test can fail: a typed number is caught
    assert not _shown("0.123456", values)


def test_the_first_screen_answers_both_questions_with_links():
    """Bug or expected behaviour in the title, the KL's own words, the change in Lightning's terms first,
    and the scope, each a click from its evidence."""
    from vae_ddp.studies.answer import _KL_WORD, HEADLINE, bug_or_expected, first_screen, kl_words

    results = _results()
    box = first_screen(results)
    title = box.splitlines()[0]
    verdict = bug_or_expected(results["report_scale"], results["seeds"])
    assert title.startswith('!!! info "') and HEADLINE[verdict["kind"]] in title and "issues/6789" in title
    kl = kl_words(results["seeds"], results["long_horizon"])
    assert f"DDP's final KL {_KL_WORD[kl['seeds']['word']]}" in box
    # the verdict's scope: the model, the weights, the batch, the data, the Lightning version, and what is not decided
    assert "from its initial weights" in box and "Not decided here: " in box and "GPUs" in box
    if results.get("step_equality") and results.get("report_training"):  # trained weights and trainings: said
        assert "from weights trained" in box and " seeds x " in box and "longer trainings" in box
    else:
        assert "Not decided here: trained weights" in box
    assert "**DDP's KL**" in box and "**DP's match**" in box and "do not explain it" in box and "not measured" in box
    # the change, two promises, in 2.x and 1.2.6 names
    assert "**Same model in distribution**" in box and "**Same step as one device**" in box
    assert "global_rank" in box and "training_step" in box  # a per-rank seed that 1.2.6 does not undo
    assert "use_distributed_sampler=False" in box and "replace_sampler_ddp=False" in box and "q.rsample()" in box
    for link in ("is-it-a-bug.md#documented-behaviour", "is-it-a-bug.md#the-kl", "is-it-a-bug.md#the-change-for-2-gpus",
                 "index.md#the-reports-scale", "legacy.md", "factors/batchnorm.md", "factors/noise.md"):
        assert link in box, link
    assert "`Trainer(sync_batchnorm=True)`" in box and "sync_dist=True" in box
    assert "|" not in box and "```" not in box


def test_one_vocabulary_per_verdict():
    """Each cell of the studies' table holds one study's word; a "different" cell never reads "within the
    margin" (made-up: a difference shown smaller than the margin; and the committed studies)."""
    from test_answer import _seeds as seeds_of
    from vae_ddp.studies.verdict import verdict_table

    small = seeds_of({"ddp": {"train_kl": "equivalent", "val_kl": "equivalent", "train_recon_loss": "different",
                              "val_recon_loss": "different"}}, train_recon_loss=-0.02, val_recon_loss=-0.02)
    assert small["summary"]["ddp"]["train_recon_loss"]["vs_single"]["within_margin"]
    for results in ({"seeds": small, "long_horizon": None, "report_scale": None}, _results()):
        table = verdict_table(results)
        rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table.splitlines() if ln.startswith("|")]
        assert "verdict" not in table.split("\n\n")[0].lower()
        for row in rows[2:]:
            for cell in row[1:]:
                assert cell.split(":")[0].split(" (")[0] in ("equivalent", "different", "inconclusive"), cell
                if cell.startswith("different"):
                    assert "within the margin" not in cell, cell
    table = verdict_table({"seeds": small, "long_horizon": None, "report_scale": None})
    assert "different: -2.0%, -2.0%, less than the margin" in table, table


def test_one_account_of_dp():
    """The account of DP on Home and "Is it a bug?" is one text, and its data order is the seed study's
    (the same batches as one device in the first epoch only), as the DP/DDP table and the Method say."""
    from vae_ddp.studies.answer import dp_account
    from vae_ddp.studies.verdict import dp_table

    results = _results()
    text = dp_account(results)
    assert "the same batches as one device in the first epoch, other batches afterwards" in text
    assert "same batches in the same order" not in dp_table(results)
    assert "the same batches as one device in the first epoch" in dp_table(results)
    bug = (ROOT / "docs" / "is-it-a-bug.md").read_text()
    assert "same in the first epoch" in bug and "different afterwards" in bug
    e = results["report_scale"]["variants"]["dp (emulation of Lightning 1.x DP)"]["effect"]["kl"]
    if e["kind"] == "different":  # DP's KL off one device's at the report's scale: never "closer"
        assert "no closer to one device than DDP" in text
    home = (ROOT / "docs" / "index.md").read_text()
    assert '--8<-- "docs/generated/home_verdict/dp_lead.md"' in home
    assert '--8<-- "docs/generated/is-it-a-bug/dp.md"' in bug


def test_the_faq_and_the_report_are_quoted_as_written():
    from vae_ddp.studies.answer import FAQ_QUOTE, faq_section

    text = faq_section(_results())
    assert f"> {FAQ_QUOTE}" in text and "work exactly the same" in FAQ_QUOTE
    report = ROOT.parent / "shared" / "upstream-report-6789.txt"
    if report.is_file():  # the report's own words, quoted on the page
        assert "specially with respect to the kl loss" in report.read_text()
    assert '("specially with respect to the kl loss")' in (ROOT / "docs" / "is-it-a-bug.md").read_text()


def test_the_reply_for_6789_is_generated_from_the_same_numbers():
    """The reply: at most 200 words of plain text in a block the page wraps, naming the project and linking
    the page, scoped as the first screen (initial weights, not decided on GPUs), covering DDP's KL and DP,
    the change in 1.2.6's names and 2.x's, with the two promises apart, and no advice for a CPU."""
    from vae_ddp.studies.answer import HEADLINE, bug_or_expected, reply

    results = _results()
    text = reply(results)
    assert text.startswith('<div class="reply" markdown>\n\n```text\n') and text.rstrip().endswith("</div>")
    body = text.split("```text\n", 1)[1].split("```", 1)[0]
    assert len(body.split()) <= 200, len(body.split())
    head = HEADLINE[bug_or_expected(results["report_scale"], results["seeds"])["kind"]]
    assert head in body and "vae-ddp" in body and "{{ page_url }}" in body
    assert "initial weights" in body and "Not decided" in body and "GPUs" in body
    assert "DDP's KL:" in body and "\nDP:" in body
    assert "replace_sampler_ddp=False" in body and "use_distributed_sampler=False" in body
    assert "Trainer(sync_batchnorm=True)" in body and "sync_dist=True" in body and "global_rank" in body
    assert "The same model in distribution" in body and "The same step as one GPU" in body
    for cpu_only in ("GlobalSyncBatchNorm", "on CPU", "on a CPU:", "--accelerator gpu"):
        assert cpu_only not in body, cpu_only


def test_the_pages_show_what_the_rules_write(generated):
    """Home's first screen and the sections of "Is it a bug?" are the generated files, which are the
    rules applied to the committed studies."""
    from vae_ddp.studies import answer
    from vae_ddp.studies.verdict import dp_table, verdict_table

    results = _results()
    data = generated("home_verdict")
    gen = ROOT / "docs" / "generated"
    assert (gen / "home_verdict" / "output.md").read_text().rstrip() == answer.first_screen(results).rstrip()
    assert data["bug"] == json.loads(json.dumps(answer.bug_or_expected(results["report_scale"], results["seeds"])))
    assert (gen / "home_verdict" / "verdict_table.md").read_text() == verdict_table(results)
    assert (gen / "home_verdict" / "dp_table.md").read_text() == dp_table(results)
    assert (gen / "home_verdict" / "dp_lead.md").read_text() == answer.dp_account(results)
    generated("is-it-a-bug")
    for name, text in {"documented": answer.documented_table(results["report_scale"]), "kl": answer.kl_section(results),
                       "faq": answer.faq_section(results), "reply": answer.reply(results),
                       "report_command": answer.command_block()}.items():
        assert (gen / "is-it-a-bug" / f"{name}.md").read_text() == text, name
    home = (ROOT / "docs" / "index.md").read_text()
    assert home.index('--8<-- "docs/generated/home_verdict/output.md"') < home.index("## ")


def test_the_training_gap_rule_on_cases_whose_answer_is_known():
    """A gap where the mean over the seeds lies outside its interval; none seen (with the smallest gap the
    study sees) where it lies within; not decided without an interval."""
    from vae_ddp.studies.answer import training_gap

    def study(mean, half):
        return {"gaps": {"ddp, logged": {"mean": mean, "half_width": half, "relative": mean / 0.02,
                                         "smallest_relative": None if half is None else half / 0.02}}}

    assert training_gap(study(0.004, 0.001)) == {"kind": "gap", "words": "a KL gap: DDP's +20% of one device's KL"}
    assert training_gap(study(-0.004, 0.001))["kind"] == "gap"
    assert training_gap(study(0.0005, 0.001)) == {"kind": "none seen",
                                                   "words": "no KL gap beyond 5% of one device's KL"}
    assert training_gap(study(0.0005, None))["kind"] == "not decided"
    assert training_gap(None)["kind"] == "not decided"
