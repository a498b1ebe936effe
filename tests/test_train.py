"""Fragment tokenization, FIM/EFIM training examples, a training smoke run and the infilling eval (tiny models)."""

import json
import math
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from typer.testing import CliRunner

from ragcache import errors
from ragcache.cli import app
from ragcache.facade import RagCache
from ragcache.infill import FimTokens, build_prompt
from ragcache.lora import attach_adapter
from ragcache.settings import LinkKnobs
from ragcache.store import open_store
from ragcache.train.evaluate import evaluate
from ragcache.train.fragment import IGNORE, ExampleBuilder, ExampleConfig, end_token_id, fragments, tokenize
from ragcache.train import link as tl
from ragcache.train.infill import TrainConfig, train
from ragcache.train.tasks import build_tasks
from tests import tiny

PRE, SUF, MID, END = 3, 4, 5, 2  # tiny tokenizer: <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>, </s>

CODE = {
    "stats.py": '''"""Small statistics helpers."""


def compute_total(values):
    total = 0
    for value in values:
        total = total + value
    return total


def compute_average(values):
    if not values:
        raise ValueError("no values")
    return compute_total(values) / len(values)
''',
    "shapes.py": '''import math


class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return self.width * self.height

    def diagonal(self):
        return math.sqrt(self.width ** 2 + self.height ** 2)
''',
    "pkg/text.py": '''def shout(message):
    return message.upper() + "!"


def whisper(message):
    return message.lower() + "..."
''',
}


def is_word(ch):
    return ch.isalnum() or ch == "_"


def ids(text):
    return tiny.tokenizer()(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("code")
    for name, text in CODE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """tiny.make("qwen2") saved as a transformers directory, tokenizer beside it."""
    return tiny.saved("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


def no_fim_tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(tiny.CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# -- fragment tokenization ---------------------------------------------------------------------------------
def test_fragments_cut_inside_words_and_join_back():
    text = CODE["stats.py"]
    parts = fragments(text, random.Random(0), mean_chars=12)
    assert "".join(parts) == text and len(parts) > 10
    bounds = [sum(map(len, parts[:i])) for i in range(1, len(parts))]
    assert any(is_word(text[b - 1]) and is_word(text[b]) for b in bounds)  # partial words at fragment ends
    assert fragments(text, random.Random(0), mean_chars=12) == parts  # seeded
    assert fragments(text, random.Random(1), mean_chars=12) != parts


def test_fragment_tokenization_changes_tokens_not_text():
    tok, text = tiny.tokenizer(), CODE["shapes.py"]
    whole = tokenize(tok, text)
    cut = tokenize(tok, text, random.Random(0), mean_chars=8)
    assert whole == ids(text)
    assert cut != whole and len(cut) > len(whole)  # boundaries inside words split tokens the BPE would merge
    assert tok.decode(cut) == text == tok.decode(whole)
    assert tokenize(tok, text, random.Random(0), mean_chars=8) == cut
    # each fragment tokenized alone, concatenated
    parts = fragments(text, random.Random(0), mean_chars=8)
    assert cut == [i for p in parts for i in ids(p)]


# -- FIM / EFIM examples -----------------------------------------------------------------------------------
def test_unfragmented_examples_match_the_serving_prompt_layout():
    tok = tiny.tokenizer()
    builder = ExampleBuilder(tok, ExampleConfig(fragment=False))
    assert builder.fim == FimTokens(PRE, SUF, MID, lead=(tok.bos_token_id,)) and builder.end_id == END == end_token_id(tok)
    prefix, middle, suffix = "def area(self):\n    return self.wi", "dth * self.hei", "ght\n"
    rng = random.Random(0)
    fim = builder.assemble(prefix, suffix, middle, "fim", None, rng)
    prompt = build_prompt(tok, builder.fim, prefix, suffix, "psm")
    assert fim.input_ids == prompt + ids(middle) + [END]
    assert fim.labels == [IGNORE] * len(prompt) + ids(middle) + [END]
    split = len(prefix) - 7  # "self.wi" typed since the base: it goes after <MID>
    efim = builder.assemble(prefix, suffix, middle, "efim", split, rng)
    prompt = build_prompt(tok, builder.fim, prefix, suffix, "efim", split=split)
    assert prompt[-len(ids("self.wi")):] == ids("self.wi")
    assert efim.input_ids == prompt + ids(middle) + [END]
    assert efim.labels == [IGNORE] * len(prompt) + ids(middle) + [END]


def test_sampled_examples_have_sentinels_in_order_and_loss_only_on_the_middle():
    tok = tiny.tokenizer()
    builder = ExampleBuilder(tok, ExampleConfig(format="both", fragment=True, mean_fragment_chars=10, max_tokens=160))
    stream = builder.stream(list(CODE.values()), seed=3)
    examples = [next(stream) for _ in range(30)]
    assert {e.format for e in examples} == {"fim", "efim"}
    assert any(e.split < len(e.prefix) for e in examples if e.format == "efim")  # an increment after <MID>
    for e in examples:
        x, y = e.input_ids, e.labels
        assert len(x) == len(y) <= 160
        assert x[:2] == [tok.bos_token_id, PRE] and [t for t in x if t in (PRE, SUF, MID)] == [PRE, SUF, MID]
        s, m, n = x.index(SUF), x.index(MID), e.prompt_length
        assert all(label == IGNORE for label in y[:n]) and all(label != IGNORE for label in y[n:])
        assert y[n:] == x[n:] and y[-1] == END and END not in x[:n]
        assert tok.decode(x[2:s]) == e.prefix[: e.split]
        assert tok.decode(x[s + 1 : m]) == e.suffix
        assert tok.decode(x[m + 1 : n]) == e.prefix[e.split :]  # empty for FIM
        assert tok.decode(x[n:-1]) == e.middle and e.middle
        if e.format == "fim":
            assert e.split == len(e.prefix)
    again = builder.stream(list(CODE.values()), seed=3)
    assert [next(again).input_ids for _ in range(30)] == [e.input_ids for e in examples]  # deterministic


def test_a_tokenizer_without_fim_sentinels_is_refused():
    with pytest.raises(errors.UnsupportedModel, match="fill-in-the-middle"):
        ExampleBuilder(no_fim_tokenizer())
    with pytest.raises(errors.BadRequest, match="unknown training format"):
        ExampleBuilder(tiny.tokenizer(), ExampleConfig(format="xyz"))


# -- training ----------------------------------------------------------------------------------------------
def test_full_fine_tune_writes_a_model_ragcache_serves(tiny_dir, code_dir, tmp_path):
    out = tmp_path / "full"
    result = train(TrainConfig(model=str(tiny_dir), data=code_dir, out=out, steps=2, lora=False, batch=2,
                               max_tokens=128, format="both"))
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    assert result.examples == 4 and result.target_tokens > 0
    assert (out / "config.json").exists() and (out / "ragcache-train.json").exists()
    rc = RagCache.open(model=str(out), store="memory:")
    before = tiny.make("qwen2").model.state_dict()
    after = rc.lm.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the weights moved
    answer = rc.infill("def area(self):\n    return self.wi", "\n", session="s", max_new_tokens=3)
    assert answer.stats.prompt_tokens > 0 and len(answer.token_ids) <= 3
    grown = rc.infill("def area(self):\n    return self.width", "\n", session="s", max_new_tokens=3)
    assert grown.stats.cached_tokens > 0


def test_lora_training_from_the_command_line(tiny_dir, code_dir, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    result = CliRunner().invoke(app, ["train", "infill", "--model", str(tiny_dir), "--data", str(code_dir),
                                      "--steps", "2", "--batch", "2", "--max-tokens", "128", "--out", str(out),
                                      "--format", "efim", "--lr", "1e-2"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output
    assert not (out / "adapter_config.json").exists()  # adapters merged: a plain transformers directory
    rc = RagCache.open(model=str(out), store="memory:")
    assert not any("lora" in k for k in rc.lm.model.state_dict())
    assert json.loads((out / "ragcache-train.json").read_text())["config"]["lora"] is True
    assert rc.infill("class Rectangle:\n    def ar", "\n", max_new_tokens=2).stats.completion_tokens <= 2


def test_training_errors_are_clear(tiny_dir, code_dir, tmp_path):
    nofim = tmp_path / "nofim"
    tiny.make("qwen2").model.save_pretrained(nofim)
    no_fim_tokenizer().save_pretrained(nofim)
    runner = CliRunner()
    refused = runner.invoke(app, ["train", "infill", "--model", str(nofim), "--data", str(code_dir), "--steps", "1",
                                  "--out", str(tmp_path / "x")])
    assert refused.exit_code == 5 and "fill-in-the-middle" in refused.output
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = runner.invoke(app, ["train", "infill", "--model", str(tiny_dir), "--data", str(empty), "--steps", "1",
                                  "--out", str(tmp_path / "y")])
    assert missing.exit_code == 3 and "no training files" in missing.output
    bad = runner.invoke(app, ["train", "infill", "--model", str(tiny_dir), "--data", str(code_dir), "--steps", "0"])
    assert bad.exit_code == 3 and "--steps" in bad.output


def test_a_device_the_machine_lacks_is_refused_before_the_model_loads(code_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner = CliRunner()
    for device, said in (("gpu", "must be auto, cpu or cuda"), ("cuda", "torch sees no CUDA device"),
                         ("cuda:0", "torch sees no CUDA device")):
        result = runner.invoke(app, ["train", "infill", "--model", str(tmp_path / "no-such-model"), "--data",
                                     str(code_dir), "--steps", "1", "--device", device])
        assert result.exit_code == 3 and said in " ".join(result.output.split()), (device, result.output)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = runner.invoke(app, ["train", "infill", "--model", str(tmp_path / "no-such-model"), "--data",
                                 str(code_dir), "--steps", "1", "--device", "cuda:1"])
    assert result.exit_code == 3 and "1 CUDA device(s)" in result.output


# -- evaluation --------------------------------------------------------------------------------------------
def test_tasks_put_the_cursor_inside_a_word_deterministically(code_dir):
    tasks = build_tasks(6, seed=1, source=code_dir, prefix_chars=120, suffix_chars=60)
    assert [t.task_id for t in tasks] == [t.task_id for t in build_tasks(6, seed=1, source=code_dir,
                                                                       prefix_chars=120, suffix_chars=60)]
    assert {t.kind for t in tasks} == {"line", "span"}
    for t in tasks:
        text = open(t.path).read()
        assert text[t.start - len(t.prefix) : t.end + len(t.suffix)] == t.prefix + t.middle + t.suffix
        assert is_word(t.prefix[-1]) and is_word(t.middle[0])  # the partial-word case
        assert 0 <= t.split < len(t.prefix) and "\n" not in t.prefix[t.split :]
        if t.kind == "line":
            assert "\n" not in t.middle and t.suffix[:1] in ("\n", "")


def test_tasks_skip_a_dangling_link_and_a_window_cut_to_nothing(code_dir, tmp_path):
    """A dangling x.py under --source was stat()'s FileNotFoundError, and --prefix-chars 0 randrange's ValueError:
    tracebacks of `train eval`."""
    source = tmp_path / "src"
    source.mkdir()
    for path in code_dir.rglob("*.py"):
        (source / path.name).write_text(path.read_text())
    (source / "gone.py").symlink_to(tmp_path / "nowhere.py")
    assert len(build_tasks(3, seed=0, source=source)) == 3
    with pytest.raises(errors.BadRequest, match="found only 0 of 2 tasks"):
        build_tasks(2, seed=0, source=source, prefix_chars=0)
    result = CliRunner().invoke(app, ["train", "eval", "--tasks", "1", "--prefix-chars", "0"])
    assert result.exit_code == 2 and "--prefix-chars" in result.output


def test_stdlib_tasks_are_deterministic():
    a = build_tasks(4, seed=0)
    assert [t.as_dict() for t in a] == [t.as_dict() for t in build_tasks(4, seed=0)]
    assert all(is_word(t.prefix[-1]) and is_word(t.middle[0]) for t in a)


def test_eval_runs_psm_and_efim_on_the_tiny_model(tiny_dir, code_dir, tmp_path):
    rc = RagCache.open(model=str(tiny_dir), store="memory:")
    tasks = build_tasks(3, seed=0, source=code_dir, prefix_chars=120, suffix_chars=60)
    report = evaluate(rc, tasks, ("psm", "efim"), max_new_tokens=3)
    assert len(report.results) == 6
    tok = tiny.tokenizer()
    fim = FimTokens.for_tokenizer(tok)
    for task, (psm, efim) in zip(tasks, zip(report.results[::2], report.results[1::2])):
        assert psm.mode == "psm" and efim.mode == "efim"
        assert psm.prompt_tokens == len(build_prompt(tok, fim, task.prefix, task.suffix, "psm"))
        assert efim.prompt_tokens == len(build_prompt(tok, fim, task.prefix, task.suffix, "efim", split=task.split))
    summary = report.summary()
    assert {(r["mode"], r["kind"]) for r in summary} >= {("psm", "all"), ("efim", "all")}
    assert all(0.0 <= r["exact_match"] <= 1.0 for r in summary)
    # a perfect prediction scores
    from ragcache.train.evaluate import score

    class Stats:
        ttft_s = total_s = 0.0
        prompt_tokens = completion_tokens = 1

    assert score(tasks[0], "psm", tasks[0].middle + "\nmore", Stats).exact is (tasks[0].kind == "line")
    assert score(tasks[1], "psm", tasks[1].middle, Stats).exact and score(tasks[1], "psm", tasks[1].middle, Stats).syntax_ok
    cli = CliRunner().invoke(app, ["train", "eval", "--model", str(tiny_dir), "--tasks", "2", "--source", str(code_dir),
                                   "--prefix-chars", "120", "--suffix-chars", "60", "--max-new-tokens", "2",
                                   "--json", str(tmp_path / "eval.json")])
    assert cli.exit_code == 0, cli.output
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert len(saved["results"]) == 4 and len(saved["tasks"]) == 2


def test_lora_without_its_targets_says_what_the_caller_can_do_instead():
    """The infill CLI's way out (--full) is in its message, and only there: other callers name their own."""
    from ragcache.train.infill import with_lora

    model = tiny.make("llama").model
    with pytest.raises(errors.BadRequest, match=r"no LoRA target modules \(nothing_here\) in this model \(or use --full\)"):
        with_lora(model, 4, 8, ("nothing_here",), otherwise="or use --full")
    with pytest.raises(errors.BadRequest) as raised:
        with_lora(model, 4, 8, ("nothing_here",))
    assert "--full" not in str(raised.value)


# -- train link on a tiny model (the fit itself: tests/test_train_link.py) ---------------------------------
LINK_ITEMS = ([tl.Item("Where is the tower?", tiny.CORPUS[:2]), tl.Item("How high is it?", tiny.CORPUS[1:3])],
              [tl.Item("When was it released?", tiny.CORPUS[2:4])])


def link_config(out, **overrides) -> tl.LinkTrainConfig:
    settings = dict(model="tiny-llama", steps=2, batch=1, lr=1e-2, rank=2, warmup=0, answer_tokens=2, out=out,
                    checkpoint_every=1)
    return tl.LinkTrainConfig(**{**settings, **overrides})


def base_entries(texts) -> dict:
    """The base model's chunk entries of `texts`, by key."""
    base = RagCache(tiny.make("llama"), open_store("memory:"))
    base.compile(texts)
    return {key: base.store.get_many([key])[0] for key in base.store.keys()}


def test_train_link_compiles_the_base_models_entries_during_and_after_the_run(tmp_path):
    """A chunk compiled while the LoRA trains (a store miss) or later by the caller's engine is the base model's
    entry, as its key says: the LoRA never runs at compile, and is gone from the engine after the run."""
    rc = RagCache(tiny.make("llama"), open_store("memory:"))

    def miss_everything(phase, done, total, note):  # after a step the LoRA is no longer zero
        if phase == "training" and done == 1:
            for key in list(rc.store.keys()):
                rc.store.delete(key)

    tl.train_link(link_config(tmp_path), rc=rc, items=LINK_ITEMS, progress=miss_everything)
    rc.compile(tiny.CORPUS[4:])  # after the run
    expected = base_entries(tiny.CORPUS)
    stored = {key: rc.store.get_many([key])[0] for key in rc.store.keys()}
    assert stored and stored.keys() <= expected.keys()
    for key, entry in stored.items():
        assert torch.equal(entry.keys, expected[key].keys) and torch.equal(entry.values, expected[key].values), key
    assert rc.lm.adapter is None and rc.lm.fingerprint == tiny.make("llama").fingerprint
    assert not any("lora" in name for name, _ in rc.lm.model.named_modules())


def test_train_link_records_the_base_weights_an_adapter_attaches_to(tmp_path):
    tl.train_link(link_config(tmp_path, steps=1), rc=RagCache(tiny.make("llama"), open_store("memory:")),
                  items=LINK_ITEMS)
    assert attach_adapter(tiny.make("llama"), tmp_path).adapter is not None
    with pytest.raises(errors.BadAdapter, match="fitted to the weights of 'tiny-llama'"):
        attach_adapter(tiny.make("llama", seed=1), tmp_path)  # the same configuration, other weights


def test_train_link_resumes_no_run_of_other_answer_tokens_or_weights(tmp_path):
    """The checkpoint is of targets made with --answer-tokens and of the model's weights, not only its name."""
    tl.train_link(link_config(tmp_path, steps=1), rc=RagCache(tiny.make("llama"), open_store("memory:")),
                  items=LINK_ITEMS)
    with pytest.raises(errors.BadRequest, match="other settings or items .*answer_tokens: 2 there, 3 now"):
        tl.train_link(link_config(tmp_path, steps=2, answer_tokens=3),
                      rc=RagCache(tiny.make("llama"), open_store("memory:")), items=LINK_ITEMS)
    with pytest.raises(errors.BadRequest, match="other settings or items .*model: "):
        tl.train_link(link_config(tmp_path, steps=2), rc=RagCache(tiny.make("llama", seed=1), open_store("memory:")),
                      items=LINK_ITEMS)


def test_train_link_refuses_fewer_steps_than_its_checkpoint_before_the_model_loads(tmp_path):
    """The checkpoint's adapter is past them: the run would report --steps and save an adapter of more."""
    store = open_store("memory:")
    tl.train_link(link_config(tmp_path, steps=2), rc=RagCache(tiny.make("llama"), store), items=LINK_ITEMS)
    refused = CliRunner().invoke(app, ["train", "link", "--model", str(tmp_path / "no-such-model"), "--steps", "1",
                                       "--out", str(tmp_path)])
    assert refused.exit_code == 3 and "checkpointed after 2 steps, more than --steps 1" in refused.output
    again = tl.train_link(link_config(tmp_path, steps=2), rc=RagCache(tiny.make("llama"), store),
                          items=LINK_ITEMS)  # as many: the finished run, reported again
    assert again.steps == 2 and len(again.losses) == 2


def test_an_exact_span_ending_in_a_newline_and_indent_passes_the_syntax_check(code_dir):
    """Exact match ignores trailing whitespace; so does the syntax check, which keeps the middle's own: without the
    newline and indent the next line would be glued to the prediction."""
    from ragcache.train.evaluate import score
    from ragcache.train.tasks import InfillTask

    path = code_dir / "stats.py"
    text = path.read_text()
    start, end = text.index("otal = 0"), text.index("for value")
    task = InfillTask("stats.py:span", "span", text[:start], text[end:], text[start:end], start - 1, str(path), start,
                      end)
    assert task.middle == "otal = 0\n    "

    class Stats:
        ttft_s = total_s = 0.0
        prompt_tokens = completion_tokens = 1

    exact = score(task, "psm", task.middle, Stats)
    assert exact.exact and exact.syntax_ok
    assert score(task, "psm", "otal = 0\n", Stats).syntax_ok  # its trailing whitespace differs only
    assert score(task, "psm", "otal = (0\n    ", Stats).syntax_ok is False


def test_train_link_without_the_network_says_so_and_what_to_do_instead(tmp_path, monkeypatch):
    """SQuAD dev is fetched from PyPI on a first run: a failed download is a fetch error (exit 5), not a traceback."""
    import subprocess

    from ragcache.train import squad

    monkeypatch.setenv("RAGCACHE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(squad.subprocess, "run", lambda cmd, **_: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement bigbench==1.0.0"))
    monkeypatch.setattr(tl, "open_engine", lambda cfg: RagCache(tiny.make("llama"), open_store("memory:")))
    result = CliRunner().invoke(app, ["train", "link", "--out", str(tmp_path / "out")])
    said = " ".join(result.output.split())
    assert result.exit_code == 5 and "cannot fetch SQuAD v1.1 dev" in said and "Could not find a version" in said
    assert "--docs" in said


def test_train_link_refuses_an_unknown_dtype_before_the_model_loads(tmp_path):
    result = CliRunner().invoke(app, ["train", "link", "--model", str(tmp_path / "no-such-model"), "--dtype", "fp32",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 3 and "--dtype must be one of float32, bfloat16, got 'fp32'" in result.output


@pytest.mark.parametrize("lora", [True, False])
def test_an_interrupted_infill_run_resumes_where_its_checkpoint_left_off(tiny_dir, code_dir, tmp_path, lora):
    """Killed after its first checkpoint, the same run resumes there: the steps already taken are not trained
    again, and the result is the uninterrupted run's (losses and weights). A run with other settings is refused."""
    if lora:
        pytest.importorskip("peft")
    settings = dict(model=str(tiny_dir), data=code_dir, steps=3, lora=lora, batch=2, max_tokens=128,
                    checkpoint_every=1, lr=1e-2 if lora else 1e-3)

    def stop_after_two(step, loss):
        if step == 2:
            raise KeyboardInterrupt

    out, whole = tmp_path / "resumed", tmp_path / "whole"
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=out, **settings), progress=stop_after_two)
    assert (out / "checkpoint" / "state.pt").exists() and not (out / "config.json").exists()
    steps = []
    resumed = train(TrainConfig(out=out, **settings), progress=lambda step, loss: steps.append(step))
    assert steps == [3]  # steps 1 and 2 were checkpointed
    straight = train(TrainConfig(out=whole, **settings))
    assert resumed.losses == pytest.approx(straight.losses, rel=1e-4, abs=1e-6)
    assert resumed.examples == straight.examples == 6 and resumed.tokens == straight.tokens
    assert not (out / "checkpoint").exists()  # the model is written: the checkpoint is gone
    with pytest.raises(errors.BadRequest, match="holds a finished run"):  # not trained again from --model over it
        train(TrainConfig(out=out, **{**settings, "steps": 6}))
    a = RagCache.open(model=str(out), store="memory:").lm.model.state_dict()
    b = RagCache.open(model=str(whole), store="memory:").lm.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=tmp_path / "other", **settings), progress=stop_after_two)
    with pytest.raises(errors.BadRequest, match="other settings.*batch"):
        train(TrainConfig(out=tmp_path / "other", **{**settings, "batch": 3}))


def test_train_link_takes_the_link_knobs_whole_and_refuses_bad_ones_before_the_model_loads(tmp_path, monkeypatch):
    """`train link` takes settings.LinkKnobs as every link door does (cli_options.link_options), naive unless told;
    a knob out of range or a link training does not fit is refused before any model loads."""
    seen = []

    def open_engine(cfg):
        seen.append(cfg.link)
        raise errors.BadRequest("no engine in this test")

    monkeypatch.setattr(tl, "open_engine", open_engine)
    base = ["train", "link", "--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "out")]
    bad = CliRunner().invoke(app, [*base, "--k", "-1"])
    assert bad.exit_code == 3 and "k must be greater than or equal to 0, got -1" in bad.output and not seen
    blend = CliRunner().invoke(app, [*base, "--algorithm", "cacheblend"])
    assert blend.exit_code == 3 and "--algorithm must be one of naive, legolink, focus" in blend.output and not seen
    CliRunner().invoke(app, [*base, "--algorithm", "legolink", "--k", "4"])
    CliRunner().invoke(app, base)
    assert [knobs.given() for knobs in seen] == [{"algorithm": "legolink", "k": 4}, {"algorithm": "naive"}]
    shown = " ".join(CliRunner().invoke(app, ["train", "link", "--help"], terminal_width=200).output.split())
    assert "link algorithm (README: Algorithms) [default: naive]" in shown


def test_a_fitted_link_resolves_its_unset_knobs_as_a_served_one_and_names_them_in_its_run_key(tmp_path):
    """k left unset is the model's calibrated k, as the served link's is; the checkpoint's key holds the link
    as resolved, so a model calibrated since does not resume a run fitted to another k."""
    rc = RagCache(tiny.make("llama"), open_store("memory:"))
    cfg = link_config(tmp_path, link=LinkKnobs(algorithm="legolink"))
    rc.default_k = 8
    assert tl.label(rc.resolve(cfg.link)) == "legolink-8"
    key = tl._run_key(cfg, rc.resolve(cfg.link), [], "weights")
    rc.default_k = 32
    assert tl._run_key(cfg, rc.resolve(cfg.link), [], "weights") != key and key["k"] == 8 and "ratio" not in key
    assert tl.label(rc.resolve(LinkKnobs(algorithm="focus", ratio=0.1))) == "focus@0.1"
    assert cfg.settings()["link"] == {"algorithm": "legolink"}
    rc.close()


def test_a_save_after_a_kill_that_left_both_checkpoints_goes_on(tmp_path):
    """Killed after a save's swap but before the old checkpoint was removed: `checkpoint/` and `checkpoint.old/`
    both stand, and the next save could not rename over the old one (every step since the resume was lost)."""
    from ragcache.train import checkpoint

    def weights(folder):
        (folder / "w.bin").write_bytes(b"w")

    checkpoint.save(tmp_path, weights, {"step": 1}, {"run": 1})
    (tmp_path / "checkpoint.old").mkdir()
    (tmp_path / "checkpoint.old" / "w.bin").write_bytes(b"stale")
    checkpoint.save(tmp_path, weights, {"step": 2}, {"run": 1})
    assert checkpoint.load(tmp_path, {"run": 1})[1]["step"] == 2 and not (tmp_path / "checkpoint.old").exists()
    (tmp_path / "checkpoint" / checkpoint.STATE).write_bytes(b"cut short")
    with pytest.raises(errors.BadRequest, match="cannot be read"):
        checkpoint.load(tmp_path, {"run": 1})


def test_a_run_resumed_with_more_steps_keeps_the_warm_up_it_began_with(tiny_dir, code_dir, tmp_path):
    """The default warm-up is a tenth of the steps: a run extended past its first --steps recomputed it from the new
    count on resume, and its learning rate fell back into a warm-up it had finished."""
    from ragcache.train import checkpoint

    settings = dict(model=str(tiny_dir), data=code_dir, lora=False, batch=1, max_tokens=64, checkpoint_every=1,
                    lr=1e-3)

    def stop_after(n):
        def stop(step, loss):
            if step == n:
                raise KeyboardInterrupt
        return stop

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=out, steps=20, **settings), progress=stop_after(2))  # warm-up 2: done by step 2
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=out, steps=80, **settings), progress=stop_after(3))  # 8 from 80 steps: lr 4/9
    state = torch.load(checkpoint.find(out) / checkpoint.STATE, weights_only=True)
    assert state["step"] == 3 and state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-3)


def test_train_infill_reads_no_hidden_folder(tmp_path):
    """`--data .` read a virtual environment's site-packages (.venv) and .git, which compile and train link skip."""
    from ragcache.train.infill import read_texts

    (tmp_path / "a.py").write_text("x = 1\n")
    for hidden in (".venv/lib/site-packages/b.py", "pkg/.cache/c.py"):
        (tmp_path / hidden).parent.mkdir(parents=True)
        (tmp_path / hidden).write_text("y = 2\n")
    assert read_texts(tmp_path) == ["x = 1\n"]


def test_an_infill_run_is_not_resumed_over_other_weights_at_its_model_path(code_dir, tmp_path):
    """The run's key named its model by path alone: a checkpoint there replaced by another of the same shape took
    the run's weights and Adam moments, fitted to the old one."""
    model = tiny.saved("qwen2", tmp_path / "model")
    settings = dict(model=str(model), data=code_dir, steps=3, lora=False, batch=2, max_tokens=128,
                    checkpoint_every=1, lr=1e-3)

    def stop(step, loss):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=tmp_path / "out", **settings), progress=stop)
    tiny.make("qwen2", seed=1).model.save_pretrained(model)
    with pytest.raises(errors.BadRequest, match="other settings.*weights"):
        train(TrainConfig(out=tmp_path / "out", **settings))


def test_training_out_of_device_memory_is_a_typed_error_that_says_what_to_change(code_dir, tmp_path, monkeypatch):
    """torch's OutOfMemoryError is a RuntimeError, which the command did not catch: a traceback and exit code 1."""
    from ragcache.train import infill

    def out_of_memory(cfg, progress=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(infill, "train", out_of_memory)
    result = CliRunner().invoke(app, ["train", "infill", "--data", str(code_dir), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and not isinstance(result.exception, torch.OutOfMemoryError)
    assert "ran out of device memory" in result.output and "--batch" in result.output


def test_a_glob_pathlib_cannot_take_is_bad_input_for_train_infill_too(tmp_path):
    """An absolute or empty --glob was pathlib's NotImplementedError or ValueError, a traceback of `train infill`."""
    from ragcache.train.infill import read_texts

    (tmp_path / "a.py").write_text("x = 1\n")
    for glob in (str(tmp_path / "*.py"), "", "**.py"):
        with pytest.raises(errors.BadRequest, match="--glob"):
            read_texts(tmp_path, glob)
    assert read_texts(tmp_path, "*.py") == ["x = 1\n"]
