"""`ragcache train link`: the differentiable cheap link, the distillation loop, checkpoints, and serving the adapter
(the built-in smollm2-135m in float32; each test loads its own copy, since training injects LoRA into the model)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ragcache import errors, lora, models
from ragcache.cli import app
from ragcache.engine import cache_argument
from ragcache.facade import RagCache
from ragcache.errors import BadAdapter
from ragcache.settings import DATA_DIR, LinkKnobs
from ragcache.store import open_store
from ragcache.train import link as tl

pytestmark = pytest.mark.real_model
pytest.importorskip("peft")


def builtin_items(n: int, start: int = 0) -> list[tl.Item]:
    """Questions of the sample set over their own document and the next one (about 250 tokens a prompt)."""
    rows = [json.loads(line) for line in (DATA_DIR / "questions.jsonl").read_text().splitlines() if line.strip()]
    names = sorted(p.name for p in (DATA_DIR / "docs").glob("*.txt"))
    items = []
    for row in rows[start:start + n]:
        other = names[(names.index(row["doc"]) + 1) % len(names)]
        items.append(tl.Item(row["question"], [(DATA_DIR / "docs" / name).read_text() for name in (other, row["doc"])]))
    return items


def config(tmp_path, **overrides) -> tl.LinkTrainConfig:
    """A run's settings; the link's knobs by name as well (algorithm, k, ratio), taken whole as the config's link."""
    settings = dict(model="smollm2-135m", algorithm="naive", steps=4, batch=3, lr=2e-3, rank=4, warmup=1,
                    answer_tokens=4, out=tmp_path, checkpoint_every=1, dtype="float32")
    settings.update(overrides)
    link = LinkKnobs(**{name: settings.pop(name) for name in LinkKnobs.model_fields if name in settings})
    return tl.LinkTrainConfig(link=link, **settings)


ITEMS = (builtin_items(3), builtin_items(2, start=3))


def engine(tmp_path) -> RagCache:
    return RagCache(models.load("smollm2-135m", dtype="float32"), open_store(f"disk:{tmp_path / 'store'}"))


@pytest.mark.parametrize("algorithm,kwargs", [("naive", {}), ("legolink", {"k": 4}), ("focus", {"ratio": 0.2})])
def test_the_differentiable_link_is_the_linkers(tmp_path, algorithm, kwargs):
    """With no adapter the student's logits are the linker's own: training fits the link the engine serves."""
    rc = engine(tmp_path)
    cfg = config(tmp_path, algorithm=algorithm, **kwargs)
    item = ITEMS[0][0]
    target = tl.prepare(rc, item, cfg.answer_tokens)
    with torch.no_grad():
        student = tl.linked_logits(rc.lm.model, tl.place(rc, target, cfg), [])[0]
    served = rc.link(item.question, target.doc_ids, algorithm=algorithm, **kwargs).last_logits
    assert torch.allclose(student, served, atol=2e-3, rtol=1e-3), (student - served).abs().max()
    full = rc.link(item.question, target.doc_ids, algorithm="full").last_logits
    assert torch.allclose(target.logprobs[0], torch.log_softmax(full, -1), atol=1e-4)
    with torch.no_grad():  # the full term's forward is the engine's full, at every answer position
        own_full = tl.full_logits(rc.lm.model, tl.place(rc, target, cfg), target.answer)
    assert torch.allclose(torch.log_softmax(own_full, -1), target.logprobs, atol=2e-3)


def test_the_student_hands_its_cache_by_the_name_the_models_forward_takes(tmp_path, monkeypatch):
    """transformers renamed `past_key_values` to `cache` between the versions supported: a student that passed
    `cache=` to an older model lost the placed chunks (the runner asks the model, `cache_argument`; so does it)."""
    rc = engine(tmp_path)
    cfg = config(tmp_path)
    placed = tl.place(rc, tl.prepare(rc, ITEMS[0][0], cfg.answer_tokens), cfg)
    inner = rc.lm.model.model
    with torch.no_grad():
        today = tl.linked_logits(rc.lm.model, placed, [])

    def older(input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, use_cache=None):
        return inner.__class__.forward(inner, input_ids=input_ids, position_ids=position_ids,
                                       attention_mask=attention_mask, use_cache=use_cache,
                                       **{cache_argument(inner): past_key_values})

    monkeypatch.setattr(inner, "forward", older)
    with torch.no_grad():
        before = tl.linked_logits(rc.lm.model, placed, [])
    assert torch.equal(today, before)


def test_training_lowers_the_distillation_loss_on_its_items(tmp_path):
    cfg = config(tmp_path, steps=6)
    report = tl.train_link(cfg, items=(ITEMS[0], ITEMS[0]))  # held out = the training items: the fit is measured
    fit = report.held_out["kl_answer"]
    assert fit["base"] > 0.01, fit  # naive linking loses something to fit on these items
    assert fit["adapted"] < 0.7 * fit["base"], fit
    assert report.losses[-1] < report.losses[0]


def test_the_full_term_lowers_the_adapted_models_distance_to_the_base_full(tmp_path):
    """An adapter that moved the model's own full away from the base's is brought back by the keep-full term."""
    from ragcache.train.infill import with_lora

    rc = engine(tmp_path)
    cfg = config(tmp_path, algorithm="focus", ratio=0.2, keep_full=20.0, keep_full_every=1)
    targets = [tl.prepare(rc, item, cfg.answer_tokens) for item in ITEMS[0][:2]]
    torch.manual_seed(0)
    peft = with_lora(rc.lm.model, cfg.rank, 2 * cfg.rank, tl.ATTENTION)
    params = [p for p in peft.parameters() if p.requires_grad]
    with torch.no_grad():  # a drifted adapter: LoRA's B starts at zero, which would leave nothing to lower
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.06)
    optimizer = torch.optim.AdamW(params, lr=2e-4)  # Adam moves every weight by about lr a step: 5e-3 overshoots
    kept = []
    for step in range(1, 5):  # measured: 0.058 -> 0.018 -> 0.008 -> 0.011 over the first four
        link_kl, full_kl = tl.train_step(rc, cfg, targets, [0, 1], params, step)
        kept.append(full_kl)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert kept[0] > 0.005, kept  # the drift is there to undo
    assert kept[-1] < 0.7 * kept[0], kept
    assert tl.train_step(rc, config(tmp_path, algorithm="focus", ratio=0.2), targets, [0], params)[1] is None


def test_a_resumed_run_continues_from_its_checkpoint(tmp_path, monkeypatch):
    """The richest recipe (focus rows, the keep-full term on every 2nd item), so every piece of state is resumed."""
    recipe = dict(algorithm="focus", ratio=0.2, keep_full=1.0, keep_full_every=2)
    out, whole = tmp_path / "resumed", tmp_path / "whole"
    first = tl.train_link(config(out, steps=1, **recipe), items=ITEMS)
    assert (out / "checkpoint" / "state.pt").exists()
    for name in ("adapter_model.safetensors", lora.ADAPTER_META):  # what a run killed before its end lacks
        (out / name).unlink()
    with monkeypatch.context() as patch:  # each item's target file is read back, not prepared again
        patch.setattr(tl, "prepare", lambda *args: pytest.fail("a target was prepared again"))
        resumed = tl.train_link(config(out, steps=2, **recipe), items=ITEMS)
    for prepared in ("targets", "store"):  # the same targets and entries, read back rather than made again
        shutil.copytree(out / prepared, whole / prepared)
    straight = tl.train_link(config(whole, steps=2, **recipe), items=ITEMS)
    assert resumed.losses[:1] == first.losses  # read back from the checkpoint, not trained again
    assert resumed.losses == pytest.approx(straight.losses, rel=1e-4, abs=1e-6)
    assert resumed.full_losses == pytest.approx(straight.full_losses, rel=1e-4, abs=1e-6)
    assert len(straight.full_losses) == 2  # batch 3, every 2nd item: each step takes it
    from safetensors.torch import load_file
    a, b = load_file(out / "adapter_model.safetensors"), load_file(whole / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    # a run with other settings does not resume this one
    with pytest.raises(Exception, match="other settings"):
        tl.train_link(config(out, steps=3, lr=1e-3, **recipe), items=ITEMS)
    with pytest.raises(Exception, match="other settings"):
        tl.train_link(config(out, steps=3, **{**recipe, "keep_full": 2.0}), items=ITEMS)


def test_training_under_focus_links_as_the_adapted_engine_serves(tmp_path):
    """Under focus the rows are chosen by the adapted model, as the engine opened with the adapter chooses them, and
    the differentiable link with the adapter on gives the served link's logits."""
    cfg = config(tmp_path / "out", algorithm="focus", ratio=0.2, steps=3, lr=5e-3)
    store = open_store("memory:")
    rc = RagCache(models.load("smollm2-135m", dtype="float32"), store)
    base = RagCache(models.load("smollm2-135m", dtype="float32"), store)
    item = ITEMS[1][0]
    target = tl.prepare(base, item, cfg.answer_tokens)
    seen = {}

    def at_the_end(phase, done, total, note):  # the training engine, its LoRA trained and switched on
        if phase == "held-out" and done == total:
            seen["trained"] = tl.place(rc, target, cfg)
            with torch.no_grad():
                seen["student"] = tl.linked_logits(rc.lm.model, seen["trained"], [])[0]

    tl.train_link(cfg, rc=rc, items=ITEMS, progress=at_the_end)
    served = RagCache.open("smollm2-135m", store, dtype="float32", adapter=str(cfg.out))
    trained, plain = seen["trained"], tl.place(base, target, cfg)
    assert torch.equal(trained.rows, tl.place(served, target, cfg).rows)
    question_only = tl.place(base, target, config(tmp_path, algorithm="naive")).rows
    assert trained.rows.numel() == plain.rows.numel() > question_only.numel()  # focus's budget, chunk rows in it
    link = served.link(item.question, target.doc_ids, algorithm="focus", ratio=0.2).last_logits
    assert torch.allclose(seen["student"], link, atol=2e-3, rtol=1e-3), (seen["student"] - link).abs().max()
    assert torch.equal(tl.place(rc, target, cfg).rows, plain.rows)  # the caller's engine is the base model again


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter")
    tl.train_link(config(out, steps=3), items=ITEMS)
    return out


def test_the_adapter_serves_through_open_and_reads_the_base_models_entries(adapter, tmp_path):
    store = open_store("memory:")
    base = RagCache(models.load("smollm2-135m", dtype="float32"), store)
    adapted = RagCache.open("smollm2-135m", store, dtype="float32", adapter=str(adapter))
    assert adapted.lm.adapter is not None and adapted.lm.adapter.sha256 == lora.adapter_sha256(adapter)
    assert adapted.lm.fingerprint != base.lm.fingerprint  # calibration profiles are the adapted model's own
    item = ITEMS[1][0]
    doc_ids = base.compile(item.documents)
    chunk = adapted.document_chunks(doc_ids[0])[0]
    layout = base.layouts["default"]
    # read-side: the adapter never runs at compile, so the entries and their keys are the base model's
    assert adapted.compiler.key(chunk, layout) == base.compiler.key(chunk, layout)
    mine, theirs = adapted.compiler.compile(chunk, layout), base.compiler.compile(chunk, layout)
    assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    linked = adapted.link(item.question, doc_ids, algorithm="naive").last_logits
    plain = base.link(item.question, doc_ids, algorithm="naive").last_logits
    assert not torch.allclose(linked, plain, atol=1e-3)
    assert RagCache.open("smollm2-135m", store, dtype="float32", adapter=None).lm.adapter is None


def test_a_broken_or_foreign_adapter_is_refused(adapter, tmp_path):
    lm = models.load("smollm2-135m", dtype="float32")
    with pytest.raises(BadAdapter, match="missing"):
        lora.attach_adapter(lm, tmp_path / "nothing")
    foreign = tmp_path / "foreign"
    shutil.copytree(adapter, foreign, ignore=shutil.ignore_patterns("store", "checkpoint*", "targets"))
    meta = json.loads((foreign / lora.ADAPTER_META).read_text())
    (foreign / lora.ADAPTER_META).write_text(json.dumps({**meta, "base_config": "0" * 32, "base_model": "other"}))
    with pytest.raises(BadAdapter, match="another configuration"):
        lora.attach_adapter(lm, foreign)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapter, corrupt, ignore=shutil.ignore_patterns("store", "checkpoint*", "targets"))
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(BadAdapter, match="does not match"):  # its record's digest says so first
        lora.attach_adapter(models.load("smollm2-135m", dtype="float32"), corrupt)
    older = {k: v for k, v in meta.items() if k != "adapter_sha256"}  # a record from before digests were kept
    (corrupt / lora.ADAPTER_META).write_text(json.dumps(older))
    with pytest.raises(BadAdapter, match="cannot load"):
        lora.attach_adapter(models.load("smollm2-135m", dtype="float32"), corrupt)


def test_cli_train_link_help_and_a_two_step_run_on_own_documents(tmp_path):
    runner = CliRunner()
    shown = runner.invoke(app, ["train", "link", "--help"], terminal_width=200)
    assert shown.exit_code == 0 and "--keep-full" in shown.output and "--keep-full-every" in shown.output
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in sorted(p.name for p in (DATA_DIR / "docs").glob("*.txt"))[:15]:  # 3 held out (every fifth)
        shutil.copy(DATA_DIR / "docs" / name, docs / name)
    out = tmp_path / "out"
    result = runner.invoke(app, ["train", "link", "--docs", str(docs), "--steps", "2", "--batch", "1",
                                 "--train-items", "2", "--eval-items", "1", "--answer-tokens", "2", "--rank", "2",
                                 "--out", str(out), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "held out" in result.output and "top1" in result.output
    assert (out / "adapter_model.safetensors").exists()
    meta = json.loads((out / lora.ADAPTER_META).read_text())
    assert meta["report"]["items"] == {"train": 2, "eval": 1} and len(meta["report"]["losses"]) == 2


def test_targets_are_prepared_once_and_memory_mapped_from_their_files(tmp_path, monkeypatch):
    """A target's log-probs (1.5 MB an item on SmolLM2) stay in their file, mapped, not copied into memory: a run of
    thousands of items must not need them all resident; and an item prepared once is read back, not prepared again."""
    from types import SimpleNamespace

    made = {}

    def prepare(rc, item, answer_tokens):
        made[item.question] = tl.Target(item.question, ["d" * 32], [1, 2], torch.randn(2, 4096))
        return made[item.question]

    monkeypatch.setattr(tl, "prepare", prepare)
    rc = SimpleNamespace(lm=SimpleNamespace(fingerprint="f" * 32))
    sets = {"train": [tl.Item(f"question {i}?", ["a document"]) for i in range(3)]}
    cfg = config(tmp_path)
    targets = tl.load_or_prepare(rc, cfg, sets, lambda *_: None)["train"]
    maps = Path("/proc/self/maps").read_text()
    files = sorted((tmp_path / "targets").rglob("*.pt"))
    assert len(files) == 3 and all(str(f) in maps for f in files)  # each file mapped into this process
    assert all(torch.equal(t.logprobs, made[t.question].logprobs) and t.answer == [1, 2] for t in targets)
    monkeypatch.setattr(tl, "prepare", lambda *args: pytest.fail("a target was prepared again"))
    again = tl.load_or_prepare(rc, cfg, sets, lambda *_: None)["train"]
    assert [t.question for t in again] == [t.question for t in targets]


def test_squad_items_hold_out_seed_1_and_train_on_other_paragraphs(tmp_path, monkeypatch):
    dev = {"data": [{"title": f"t{a}", "paragraphs": [
        {"context": f"a{a} p{p}", "qas": [{"id": f"{a}.{p}.{q}", "question": f"q{a}.{p}.{q}",
                                            "answers": [{"text": f"p{p}"}]} for q in range(3)]} for p in range(3)]}
        for a in range(6)]}
    monkeypatch.setenv("RAGCACHE_DATA_DIR", str(tmp_path))
    (tmp_path / "squad-dev-v1.1.json").write_text(json.dumps(dev))
    training, held_out = tl.squad_items(200, 4)
    seen = {d for item in held_out for d in item.documents}
    assert len(held_out) == 4 and all(len(item.documents) == 4 for item in training + held_out)
    assert not seen & {d for item in training for d in item.documents}  # no paragraph of a held-out item
    assert len(training) == 3 * (6 * 3 - len(seen))  # every question of every other paragraph
    assert tl.squad_items(200, 4) == (training, held_out)  # seeded


def test_paragraphs_held_out_of_training_appear_in_no_training_prompt():
    """`train link --docs`: every fifth paragraph's question is held out, and its paragraph must not be a training
    item's distractor (nor a training paragraph a held-out item's), or the held-out report is optimistic."""
    from types import SimpleNamespace

    class Base:
        def compile(self, texts):
            return [str(abs(hash(t))) for t in texts]

        def query(self, *args, **kwargs):
            return SimpleNamespace(text="What does the paragraph say?")

    texts = [f"Paragraph {i} says something. " + "word " * 20 for i in range(20)]
    training, held_out = tl.docs_items(Base(), texts, 100, 100, seed=0)
    held = {text for i, text in enumerate(texts) if i % 5 == 4}
    assert len(training) == 16 and len(held_out) == 4
    assert all(set(item.documents) <= held for item in held_out)
    assert not any(set(item.documents) & held for item in training)
    with pytest.raises(errors.BadRequest, match="15 to hold out"):
        tl.docs_items(Base(), texts[:10], 100, 100, seed=0)
    # splits full early: the bar ends at its total, not where the last question was written
    said = []
    tl.docs_items(Base(), texts, 2, 1, seed=0, say=lambda done, total: said.append((done, total)))
    assert said[-1] == (20, 20)


def test_questions_written_from_docs_are_kept_in_out_and_read_back_by_a_resumed_run(tmp_path):
    """A resumed `--docs` run wrote every question again (minutes at thousands of paragraphs), and on another device a
    greedy question may differ by a token: the run's key hashes its items, so the resume was refused."""
    from types import SimpleNamespace

    class Base:
        def __init__(self, fingerprint, wording):
            self.lm, self.wording, self.asked = SimpleNamespace(fingerprint=fingerprint), wording, 0

        def compile(self, texts):
            return [str(abs(hash(t))) for t in texts]

        def query(self, *args, **kwargs):
            self.asked += 1
            return SimpleNamespace(text=f"What does the paragraph {self.wording}?")

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("\n\n".join(f"Paragraph {i} says something. " + "word " * 20 for i in range(20)))
    cfg, out = config(tmp_path / "out", docs=str(docs), train_items=3, eval_items=1), tmp_path / "out"
    out.mkdir()
    first = tl.written_items(Base("weights", "say"), cfg, out, lambda done, total: None)
    again, other_model = Base("weights", "tell"), Base("other weights", "tell")
    assert tl.written_items(again, cfg, out, lambda done, total: None) == first and again.asked == 0
    assert tl.written_items(other_model, cfg, out, lambda done, total: None) != first and other_model.asked


def test_train_link_runs_on_the_gpu_where_there_is_one_and_refuses_a_device_this_machine_lacks(tmp_path, monkeypatch):
    """`--device auto` (the default) is CUDA where torch sees a GPU, as for `train infill`: it used to load the model
    on the CPU whatever the machine had."""
    loads, load = [], models.load
    monkeypatch.setattr(tl.models, "load", lambda model, dtype, device: loads.append(device) or load(
        model, dtype=dtype, device="cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    tl.open_engine(config(tmp_path))
    assert loads == ["cuda"]
    monkeypatch.undo()
    with pytest.raises(errors.ParameterOutOfRange, match="cuda"):
        config(tmp_path, device="cuda:7").validate()
    shown = CliRunner().invoke(app, ["train", "link", "--help"], terminal_width=200)
    assert "--device" in shown.output
    # the knobs a fitted link reads, not those it would refuse (--repair, --check-layer, --deviation)
    assert all(f"--{name} " in shown.output for name in ("algorithm", "k", "ratio"))
    assert not any(name in shown.output for name in ("--repair", "--check-layer", "--deviation"))


@pytest.mark.parametrize("knobs, unread", [(dict(algorithm="legolink", ratio=0.3), "--ratio"),
                                           (dict(algorithm="focus", k=4), "--k"),
                                           (dict(algorithm="naive", repair=8), "--repair"),
                                           (dict(algorithm="focus", check_layer=1), "--check-layer")])
def test_a_knob_the_fitted_link_does_not_read_is_refused(tmp_path, knobs, unread):
    """It shaped neither the link fitted nor the run's key: the user would believe they trained under it."""
    with pytest.raises(errors.BadRequest, match=unread):
        config(tmp_path, **knobs).validate()
    config(tmp_path, algorithm="focus", ratio=0.1).validate()
    config(tmp_path, algorithm="legolink", k=4).validate()


def test_a_paragraph_repeated_across_files_is_one_paragraph(tmp_path):
    """A licence or footer in every file was trained on and held out both (every fifth paragraph is held out)."""
    from ragcache.train.link import paragraphs

    footer = "This text is released under a licence that allows copying and changing it, as long as this note " \
             "stays with every copy that is made of it."
    for n in range(3):
        (tmp_path / f"{n}.md").write_text(f"Paragraph {n} " + "word " * 25 + f"\n\n{footer}\n")
    found = paragraphs(tmp_path)
    assert found.count(" ".join(footer.split())) == 1 and len(found) == 4


def test_docs_without_paragraphs_are_refused_before_the_model_loads(tmp_path):
    """A misspelt --docs loaded the model (and made --out's store) before it said "no such file"; files as compile
    reads them: .TXT too, hidden folders not."""
    from ragcache.errors import BadRequest
    from ragcache.train.link import paragraphs

    with pytest.raises(BadRequest, match="no such file"):
        config(tmp_path, docs=tmp_path / "mydcos").validate()
    (tmp_path / "docs" / ".git").mkdir(parents=True)
    (tmp_path / "docs" / ".git" / "notes.txt").write_text("word " * 30)
    with pytest.raises(BadRequest, match="no paragraph"):
        config(tmp_path, docs=tmp_path / "docs").validate()
    (tmp_path / "docs" / "README.TXT").write_text("word " * 30)
    config(tmp_path, docs=tmp_path / "docs").validate()
    assert paragraphs(tmp_path / "docs") == [" ".join(["word"] * 30)]


def test_train_link_closes_an_engine_it_opened_however_it_ends(tmp_path, monkeypatch):
    """`ragcache train link` opened a disk store and a model thread and never closed them."""
    from types import SimpleNamespace

    closed = []

    class Own:
        lm = SimpleNamespace(adapter="already adapted")  # refused at once: the engine must still be closed

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            closed.append(exc_info[0])

    monkeypatch.setattr(tl, "open_engine", lambda cfg: Own())
    with pytest.raises(errors.BadRequest, match="base model"):
        tl.train_link(config(tmp_path))
    assert closed == [errors.BadRequest]


def test_the_train_link_command_closes_the_engine_it_opens(tmp_path, monkeypatch):
    """The CLI hands train_link an engine of its own opening, which train_link leaves to its caller: the command
    must close it (its model thread, its disk store's writes) however the run ends."""
    from types import SimpleNamespace

    closed = []

    class Own:
        lm = SimpleNamespace(adapter=None)

        def close(self):
            closed.append(True)

    def failing(cfg, rc=None, progress=None):
        raise errors.BadRequest("no item fits")

    monkeypatch.setattr(tl, "open_engine", lambda cfg: Own())
    monkeypatch.setattr("ragcache.train.cli.train_link", failing, raising=False)
    monkeypatch.setattr(tl, "train_link", failing)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("\n\n".join(" ".join(f"w{i}{j}" for j in range(25)) for i in range(15)))
    result = CliRunner().invoke(app, ["train", "link", "--docs", str(docs), "--steps", "1", "--out",
                                      str(tmp_path / "out")])
    assert result.exit_code == 3 and closed == [True], result.output


def test_a_paragraph_or_item_longer_than_the_context_is_left_out_not_the_run(tmp_path, monkeypatch, caplog):
    """One long block of --docs (a table, generated markdown) raised PromptTooLong and ended the run, and a rerun
    hit it again: the paragraph (or the item that holds it) is left out, said in the log, and the run goes on."""
    from types import SimpleNamespace

    texts = [f"Paragraph {i} says something. " + "word " * 20 for i in range(20)]

    class Base:
        def compile(self, texts):
            return list(texts)

        def query(self, question, doc_ids, **kwargs):
            if doc_ids == [texts[0]]:
                raise errors.PromptTooLong(9000, 40, 8192)
            return SimpleNamespace(text="What does the paragraph say?")

    with caplog.at_level("WARNING", logger="ragcache"):
        training, held_out = tl.docs_items(Base(), texts, 100, 100, seed=0)
    assert len(training) == 15 and len(held_out) == 4 and "paragraph 1 left out" in caplog.text

    def prepare(rc, item, answer_tokens):
        if item.question == "question 1?":
            raise errors.PromptTooLong(9000, 40, 8192)
        return tl.Target(item.question, ["d" * 32], [1], torch.randn(1, 8))

    monkeypatch.setattr(tl, "prepare", prepare)
    rc = SimpleNamespace(lm=SimpleNamespace(fingerprint="f" * 32))
    sets = {"train": [tl.Item(f"question {i}?", ["a document"]) for i in range(3)]}
    targets = tl.load_or_prepare(rc, config(tmp_path), sets, lambda *_: None)["train"]
    assert [t.question for t in targets] == ["question 0?", "question 2?"] and "train item 2 left out" in caplog.text


def test_the_cache_a_student_is_cloned_from_is_settled_first(tmp_path, monkeypatch):
    """On CUDA a plan's layers cross from the host on a copy stream; cloned before they landed, the student would
    train on zeros or half-placed layers. place() settles the plan's cache before it is read."""
    from ragcache.engine import JoinedCache

    rc = engine(tmp_path)
    cfg = config(tmp_path)
    target = tl.prepare(rc, ITEMS[0][0], cfg.answer_tokens)
    settled = []
    settle = JoinedCache.settle
    monkeypatch.setattr(JoinedCache, "settle", lambda self: settled.append(self) or settle(self))
    tl.place(rc, target, cfg)
    assert settled
