"""Engine behaviour beyond the invariants: bad input, generation controls, chunking, documents."""

import time
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config

from ragcache import errors
from ragcache.chunker import chunk_document
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.engine.sampling import TextAssembler
from ragcache.engine import sequence
from ragcache.engine.sequence import Aborted, Status
from ragcache.models import wrap
from ragcache.store.memory import MemoryStore
from ragcache.engine.sampling import Sampling
from tests import tiny

DOC = "The Eiffel Tower is in Paris. It was completed in 1889 and is 330 metres tall."


@pytest.fixture(scope="module")
def rc():
    return RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32))


def test_empty_question(rc):
    with pytest.raises(errors.EmptyInput, match="question is empty"):
        rc.query("   ", docs=[{"text": DOC}])


def test_empty_document(rc):
    with pytest.raises(errors.EmptyInput, match="document is empty"):
        rc.compile(["fine", ""])
    with pytest.raises(errors.EmptyInput, match="document is empty"):  # checked once, by ragcache.request
        rc.compile(["   "])


def test_text_that_is_not_unicode_is_refused_naming_where(rc):
    """A lone surrogate (a JSON escape, a file name's undecodable byte) cannot be hashed or tokenized: a bad request
    naming the text, never a UnicodeEncodeError."""
    with pytest.raises(errors.InvalidText, match=r"documents\[1\] holds a lone surrogate"):
        rc.compile(["fine", "half a pair \ud800"])
    with pytest.raises(errors.InvalidText, match="the question holds"):
        rc.query("what \udce9?", docs=[{"text": DOC}])
    with pytest.raises(errors.InvalidText, match=r"docs\[0\] holds"):
        rc.query("what?", docs=[{"text": DOC + "\udfff"}])
    with pytest.raises(errors.InvalidText, match="the system prompt holds"):
        rc.query("what?", docs=[{"text": DOC}], system="\ud800")
    with pytest.raises(errors.InvalidText, match="the suffix holds"):
        rc.infill("def f():", "\ud800")


def test_unknown_document_id(rc):
    missing = "0" * 32
    with pytest.raises(errors.UnknownDocument) as info:
        rc.query("what?", docs=[missing])
    assert info.value.ids == [missing]


def test_model_without_rope_is_refused():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=400))
    with pytest.raises(errors.UnsupportedModel, match="no rotary position embeddings"):
        wrap(gpt2, tiny.tokenizer(), name="gpt2")


@pytest.mark.parametrize(
    "model_type, refusal",
    [("cohere", "rotate keys by halves"), ("gpt_oss", "rotate keys by halves|attention sinks"),
     ("smollm3", "without RoPE"), ("qwen3_next", "without the self-attention"), ("jetmoe", "without the self-attention"), ("exaone4", "without RoPE"),
     ("exaone_moe", "without RoPE"), ("gemma4_text", "inputs of its own")],
)
def test_rope_models_whose_positions_the_linker_cannot_move_are_refused(model_type, refusal):
    """Interleaved RoPE pairs (cohere, glm), layers without RoPE (smollm3, exaone hybrids), layers of another kind
    (qwen3-next, jetmoe) and attention sinks (gpt-oss) load and answer, every placed key wrong: refused at load, as
    gpt2 is."""
    from transformers import AutoConfig

    extra = {"sliding_window": 8, "sliding_window_pattern": 4} if model_type.startswith("exaone") else {}
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=400,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(errors.UnsupportedModel, match=refusal):
        wrap(model, tiny.tokenizer(), name=model_type)


@pytest.mark.parametrize("rope_type, refused", [("dynamic", True), ("longrope", True), ("made_up_later", True),
                                                ("yarn", False), ("llama3", False), ("default", False)])
def test_only_rope_types_with_fixed_frequencies_load(rope_type, refused):
    """A key is rotated once to its new position: a rope type whose frequencies follow the sequence's length, or one
    ragcache does not know (a type added to transformers later), would have every placed key wrong. Listed, not
    denied: an unknown type is refused."""
    lm = tiny.make("llama")
    lm.model.config.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0}
    if refused:
        with pytest.raises(errors.UnsupportedModel, match=f"rope type \\['{rope_type}'\\]"):
            wrap(lm.model, tiny.tokenizer(), name=rope_type)
    else:
        wrap(lm.model, tiny.tokenizer(), name=rope_type)


def test_a_model_whose_tokenizer_is_not_a_fast_one_is_refused_at_load():
    """The chunker cuts at sentence ends by character offsets, which only a fast tokenizer gives: a Python one
    failed every compile and every raw-text query instead."""
    from types import SimpleNamespace

    slow = SimpleNamespace(is_fast=False)
    with pytest.raises(errors.UnsupportedModel, match="fast tokenizer"):
        wrap(tiny.make("llama").model, slow, name="slow")


def test_prompt_longer_than_context(rc):
    long_doc = " ".join(["Rivers flow to the sea."] * 200)  # > 512 positions of the tiny model
    with pytest.raises(errors.TextsTooLong) as early:  # as raw text: refused before it is tokenized whole
        rc.query("where?", docs=[{"text": long_doc}], max_new_tokens=4)
    assert early.value.context == 512 and early.value.prompt_tokens > 512
    with pytest.raises(errors.PromptTooLong) as info:  # stored: the exact check when the query is prepared
        rc.query("where?", docs=rc.compile([long_doc]), max_new_tokens=4)
    assert info.value.context == 512 and info.value.prompt_tokens > 512
    assert "the documents take" in str(info.value)
    with pytest.raises(errors.PromptTooLong, match="the question alone is"):  # not the documents' fault
        rc.query(" ".join(["where?"] * 400), docs=[{"text": DOC}], max_new_tokens=4)


def test_a_default_answer_length_is_cut_to_the_context_left_not_refused(rc):
    """A request that names no max_tokens (OpenAI's clients mostly send none) gets the server's default cut to what
    its prompt leaves of the context: refusing it as too long for a length it never asked for was a 400."""
    from ragcache.front import drain

    ids = rc.compile([" ".join(["Rivers flow to the sea."] * 45)])
    with pytest.raises(errors.PromptTooLong):
        rc.query("where?", docs=ids, max_new_tokens=400)
    seq = rc.stream("where?", ids, max_new_tokens=400, fit_context=True)
    answer = drain(seq)
    prompt = answer.stats.prompt_tokens
    assert 0 < 512 - prompt < 400 and seq.decoding.sampling.max_new_tokens == 512 - prompt
    assert len(answer.token_ids) <= 512 - prompt
    short = rc.stream("where?", ids, max_new_tokens=3, fit_context=True)  # a default that fits stays as it is
    assert len(drain(short).token_ids) <= 3 and short.decoding.sampling.max_new_tokens == 3


@pytest.mark.parametrize("kwargs,match", [
    ({"algorithm": "magic"}, "unknown algorithm"),
    ({"k": -1}, "k must be"),
    ({"ratio": 1.5}, "ratio must be"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_parameters_out_of_range(rc, kwargs, match):
    with pytest.raises(errors.BadRequest, match=match):
        rc.query("where?", docs=[{"text": DOC}], **kwargs)


def test_raw_text_and_id_give_the_same_answer(rc):
    [doc_id] = rc.compile([DOC])
    by_text = rc.query("How tall?", docs=[{"text": DOC}], max_new_tokens=6)
    by_id = rc.query("How tall?", docs=[doc_id], max_new_tokens=6)
    assert by_text.token_ids == by_id.token_ids
    assert by_id.stats.store_hits > 0 and by_id.stats.compiled_chunks == 0


def test_a_byte_order_mark_is_no_part_of_a_document_at_any_door(rc):
    """`compile` reads a file without its BOM; a client sending the file's decoded bytes (REST, llama-index, a raw
    text) gets the same id, the same record and the same chunks, so the same answer from the same entries."""
    from ragcache.store.keys import document_id

    assert rc.compile(["\ufeff" + DOC]) == [document_id(DOC)] == rc.compile([DOC])
    assert rc.document(document_id(DOC))["text"] == DOC
    by_bom = rc.query("How tall?", docs=[{"text": "\ufeff" + DOC}], max_new_tokens=6)
    assert by_bom.token_ids == rc.query("How tall?", docs=[document_id(DOC)], max_new_tokens=6).token_ids
    with pytest.raises(errors.EmptyInput, match="document is empty"):
        rc.compile(["\ufeff"])


def test_missing_entry_is_recompiled(rc):
    [doc_id] = rc.compile([DOC])
    before = rc.query("How tall?", docs=[doc_id], max_new_tokens=6)
    for key in list(rc.store.keys()):
        rc.store.delete(key)
    after = rc.query("How tall?", docs=[doc_id], max_new_tokens=6)
    assert after.stats.compiled_chunks > 0 and after.token_ids == before.token_ids


def test_sampling_is_seeded_and_streaming_matches(rc):
    a = rc.query("How tall?", docs=[{"text": DOC}], temperature=1.0, top_p=0.9, seed=7, max_new_tokens=8)
    b = rc.query("How tall?", docs=[{"text": DOC}], temperature=1.0, top_p=0.9, seed=7, max_new_tokens=8)
    assert a.token_ids == b.token_ids
    stream = rc.stream("How tall?", docs=[{"text": DOC}], max_new_tokens=8)
    pieces = list(stream)
    assert "".join(pieces) == stream.answer.text == rc.query("How tall?", docs=[{"text": DOC}], max_new_tokens=8).text
    assert stream.answer.stats.ttft_s > 0 and stream.answer.stats.completion_tokens == 8


@pytest.mark.parametrize("knob", [dict(seed=2**64), dict(seed="7"), dict(seed=1.5), dict(temperature="0.5"),
                                  dict(top_p=None), dict(temperature=True), dict(max_new_tokens=True),
                                  dict(stop=[" Rome", 3]), dict(stop=5), dict(stop=0), dict(max_tokens=8)])
def test_sampling_values_no_schema_checked_are_typed_errors(rc, knob):
    """The Python API and the integrations' overrides reach the engine with no REST schema before them: a seed torch
    cannot take was its ValueError, a temperature given as text a TypeError from a comparison, a stop of 5 list()'s
    TypeError (of 0, no stop at all), a misspelt knob Sampling's TypeError."""
    with pytest.raises(errors.ParameterOutOfRange):
        rc.query("How tall?", docs=[{"text": DOC}], **{"max_new_tokens": 2, **knob})


def test_stop_strings_cut_and_hold_back():
    tok = tiny.tokenizer()
    ids = tok("Paris is big. Rome is old.", add_special_tokens=False)["input_ids"]
    asm = TextAssembler(tok, stop=[" Rome"])
    out = "".join(asm.push(i) for i in ids if not asm.stopped) + asm.finish()
    assert out == "Paris is big."
    assert asm.stopped


def test_draining_a_stream_someone_else_aborted_raises_cancelled(rc):
    """Not an answer of None that a caller (rc.query, llama-index's and LangChain's models) would then read."""
    from ragcache.front import drain

    stream = rc.stream("How tall?", docs=[{"text": DOC}], max_new_tokens=4)
    stream.cancel()  # as the engine's shutdown does to a request whose reader still waits
    with pytest.raises(errors.Cancelled, match="aborted"):
        drain(stream)


def test_one_token_that_completes_two_stop_strings_cuts_at_the_earliest():
    class Pieces:  # a tokenizer whose ids are whole strings: id 1 is "x", id 2 is "ab"
        def decode(self, ids, **kwargs):
            return "".join({1: "x", 2: "ab"}[i] for i in ids)

    asm = TextAssembler(Pieces(), stop=["b", "a"])  # "b" first in the list, "a" first in the text
    assert asm.push(1) + asm.push(2) + asm.finish() == "x" and asm.stopped


def _pieces_by_brute_force(chars: str, stop: list[str]) -> list[str]:
    """What each push emits, by the definition: cut at the earliest stop string in the whole text, else hold back
    the longest tail that each stop string (in order) starts with."""
    out, emitted = [], 0
    for end in range(1, len(chars) + 1):
        text = chars[:end]
        cuts = [at for s in stop if (at := text.find(s)) != -1]
        if cuts:
            return [*out, text[emitted : min(cuts)]]
        stable = len(text)
        for s in stop:
            stable -= next((n for n in range(min(len(s) - 1, stable), 0, -1) if text[:stable].endswith(s[:n])), 0)
        out.append(text[emitted:stable])
        emitted = max(emitted, stable)
    return out


@given(st.text("ab c", max_size=40), st.lists(st.text("ab c", min_size=1, max_size=6), max_size=4))
def test_stop_strings_hold_back_and_cut_as_their_definition_says(chars, stop):
    class Chars:  # a tokenizer whose ids are characters
        def decode(self, ids, **kwargs):
            return "".join(map(chr, ids))

    asm = TextAssembler(Chars(), stop)
    pieces = []
    for c in chars:
        pieces.append(asm.push(ord(c)))
        if asm.stopped:
            break
    assert pieces == _pieces_by_brute_force(chars, stop)


class CleaningUp:
    """A tokenizer that cleans up spaces before punctuation unless told not to, as GPT-2's does: "x ." decodes "x."."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True):
        text = "".join({1: "x", 2: " ", 3: ".", 4: "y"}[i] for i in ids)
        return text.replace(" .", ".") if clean_up_tokenization_spaces else text


def test_a_stop_is_found_where_decoding_changed_what_was_emitted():
    class Rewriting(CleaningUp):  # one whose own decode rewrites emitted text whatever it is told
        def decode(self, ids, **kwargs):
            return super().decode(ids)

    asm = TextAssembler(Rewriting(), stop=["."])
    assert asm.push(1) + asm.push(2) == "x " and not asm.stopped
    assert asm.push(3) == "" and asm.stopped  # "x." holds the stop, before what was emitted ended


def test_streamed_pieces_are_the_answer_with_a_tokenizer_that_cleans_up_spaces():
    """The pieces join to the whole answer's text: cut from text that clean-up rewrote, "x", " " then "x.y" lost the
    "." ("x y")."""
    asm = TextAssembler(CleaningUp(), stop=[])
    assert "".join(asm.push(i) for i in (1, 2, 3, 4)) + asm.finish() == "x .y"


def test_streamed_text_decodes_a_window_of_the_last_ids_not_the_whole_answer_each_token():
    """Each token decoded the whole answer again on the model thread (quadratic in the answer's length): a window of
    the last ids gives the same pieces, an incomplete UTF-8 character held until it completes, random ids too."""
    import random
    from types import SimpleNamespace

    tok = tiny.tokenizer()
    decoded, decode = [], tok.decode
    rng = random.Random(0)
    texts = ["Paris is big. Rome is old. " * 40, "Caf\u00e9 \u6771\u4eac \U0001f5fc\U0001f389 end. " * 20]
    for ids in [tok(t, add_special_tokens=False)["input_ids"] for t in texts] + [
        [rng.randrange(len(tok)) for _ in range(300)] for _ in range(5)
    ]:
        asm = TextAssembler(tok, [])
        asm.tokenizer = SimpleNamespace(decode=lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
        pieces = [asm.push(i) for i in ids] + [asm.finish()]
        assert "".join(pieces) == decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "\ufffd" not in "".join(pieces[:-1]) or "\ufffd" in decode(ids)  # only what the whole text holds
        assert max(decoded) <= 16 and sum(decoded) <= 8 * len(ids), (max(decoded), sum(decoded), len(ids))
        decoded.clear()


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama's, Gemma's): "\u2581" for a space, bytes for what the vocabulary
    lacks, a decode that drops the space of the text's first piece."""
    from tokenizers import Tokenizer, decoders, models as tmodels, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tmodels.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(tiny.CORPUS * 20, trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("which", ["metaspace", "smollm2"])
def test_windowed_decoding_streams_the_pieces_whole_decoding_streamed(which):
    """The same pieces, stops and held-back tails as decoding the whole answer every token, on a SentencePiece-style
    tokenizer and a byte-level one, over real text and random ids."""
    import random

    from transformers import AutoTokenizer

    from ragcache import models

    class Whole(TextAssembler):
        def _decode(self):
            return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    tok = _metaspace_tokenizer() if which == "metaspace" else AutoTokenizer.from_pretrained(models.resolve("smollm2-135m"))
    rng = random.Random(1)
    texts = ["Paris is big.  Rome is old.", "Caf\u00e9 \u6771\u4eac \U0001f5fc end.", " x = f(a)\n\n\ty"]
    for n in range(120):
        ids = (tok(rng.choice(texts), add_special_tokens=False)["input_ids"] if n % 3 == 0
               else [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))])
        whole = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        at = rng.randrange(max(len(whole), 1))
        stop = [whole[at : at + rng.randrange(1, 4)]] if whole and n % 2 else []
        streams = [TextAssembler(tok, stop), Whole(tok, stop)]
        pieces = [[], []]
        for i in ids:
            for asm, out in zip(streams, pieces):
                if not asm.stopped:
                    out.append(asm.push(i))
        windowed, by_whole = (out + [asm.finish()] for asm, out in zip(streams, pieces))
        assert windowed == by_whole, (ids, stop)


def test_a_stop_given_as_one_string_is_one_stop_string():
    """`rc.stream(..., stop="###")` (and llama-index's per-call stop): a string is one stop string, as OpenAI takes
    it, not its characters (which stopped at the first "#")."""
    from ragcache.engine.sampling import Sampling

    assert Sampling(stop="###").stop == ["###"] and Sampling(stop=None).stop == []


def test_chunker_ends_at_sentences_and_caps_at_twice_the_budget():
    tok = tiny.tokenizer()
    text = "The water returns. " * 30 + "x" * 400
    chunks = chunk_document(tok, text, budget=10)
    assert sum(len(c.token_ids) for c in chunks) == len(tok(text, add_special_tokens=False)["input_ids"])
    assert all(len(c.token_ids) <= 20 for c in chunks)
    assert all(text[c.char_start:c.char_end].rstrip().endswith(".") for c in chunks[:5])


def test_document_registry(rc):
    [doc_id] = rc.compile([DOC + " Extra."])
    assert rc.document(doc_id)["text"] == DOC + " Extra."
    assert doc_id in rc.document_ids()
    assert rc.delete_document(doc_id)
    with pytest.raises(errors.UnknownDocument):
        rc.query("what?", docs=[doc_id])


def test_sliding_window_model_decodes_past_its_window():
    rc = RagCache(tiny.make("gemma3"), MemoryStore(), EngineConfig(chunk_tokens=16))
    full = rc.query("Which mountain?", docs=[{"text": DOC}], algorithm="full", max_new_tokens=12)
    ref = tiny.make("gemma3")
    ids = rc.link("Which mountain?", [{"text": DOC}], algorithm="full").token_ids
    with torch.inference_mode():
        expected = ref.model.generate(ids[None], max_new_tokens=12, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, ids.numel():]
    assert full.token_ids == expected.tolist()[: len(full.token_ids)]


def test_a_vanishing_temperature_is_greedy(rc):
    greedy = rc.query("How tall?", docs=[{"text": DOC}], max_new_tokens=4)
    tiny_t = rc.query("How tall?", docs=[{"text": DOC}], max_new_tokens=4, temperature=1.5e-232, seed=1)
    assert tiny_t.token_ids == greedy.token_ids


def test_a_string_is_always_an_id_never_text(rc):
    """A typo'd id must not become a document made of the typo (issue 14): strings are ids, raw text is {"text": ...}."""
    for not_an_id in ("0" * 31, "How tall is it? A sentence, not an id.", "G" * 32):
        with pytest.raises(errors.BadRequest, match=r'docs\[0\] is not a document id.*\{"text": \.\.\.\}'):
            rc.query("How tall?", docs=[not_an_id], max_new_tokens=1)
    with pytest.raises(errors.BadRequest):
        rc.query("How tall?", docs=[{"text": DOC, "meta": 1}], max_new_tokens=1)
    id_like_text = "0123456789abcdef0123456789abcdef"
    answer = rc.query("What is it?", docs=[{"text": id_like_text}], max_new_tokens=1)  # as text, it is text
    assert answer.stats.prompt_tokens > 0 and rc.document(errors_free_id(id_like_text)) is not None


def errors_free_id(text: str) -> str:
    from ragcache.store.keys import document_id

    return document_id(text)


def test_the_default_algorithm_is_focus_at_a_quarter(rc):
    docs = [{"text": DOC}, {"text": "Rivers flow to the sea. The Nile is long."}]
    default = rc.link("How tall is it?", docs=docs)
    explicit = rc.link("How tall is it?", docs=docs, algorithm="focus", ratio=0.25)
    assert default.recomputed_tokens == explicit.recomputed_tokens
    assert torch.equal(default.last_logits, explicit.last_logits)
    assert rc.query("How tall is it?", docs=docs, max_new_tokens=2).stats.algorithm == "focus"


def test_focus_without_documents_skips_the_pre_pass(rc, monkeypatch):
    """With no chunk rows to choose there is nothing to score: the question's naive pass would be wasted work."""
    from ragcache import linker

    def scored(*_):
        raise AssertionError("the pre-pass ran with no chunks to score")

    monkeypatch.setattr(linker, "question_attention", scored)
    linked = rc.link("How tall is it?", docs=[], algorithm="focus")
    assert torch.equal(linked.last_logits, rc.link("How tall is it?", docs=[], algorithm="naive").last_logits)


def test_a_link_of_chunks_without_a_question_is_refused_not_left_waiting(rc):
    """naive over chunks with no question recomputes no row: its sequence was placed and then waited forever for
    rows, the model thread spinning; legolink's last recomputed row was a chunk's, its logits not the next token's.
    Front's prompts always carry a question; a caller building LinkInput itself (research, a connector) may not."""
    from ragcache import linker
    from ragcache.linker import LinkInput, LinkParams

    layout = rc.layouts["default"]
    ids = rc.tokenizer.encode(tiny.CORPUS[0], add_special_tokens=False)[:8]
    entry = rc.compiler.compile(ids, layout)
    chunk = rc.compiler.stored_ids(ids, layout)
    for name in ("naive", "legolink"):
        with pytest.raises(errors.EmptyInput, match="needs a question"):
            linker.plan(rc.runner, LinkInput([], [chunk], [], None, [entry]), LinkParams(name))
    asked = linker.plan(rc.runner, LinkInput([], [chunk], [5, 6], None, [entry]), LinkParams("naive"))
    assert asked.rows.tolist() == [len(chunk), len(chunk) + 1]


def test_a_prefix_lookup_finds_a_repeat_or_whole_pieces_never_the_last_row():
    """One scan says both: an exact repeat (its kept logits, even beside a longer prompt that starts with it), or
    the reusable rows cut back to whole pieces and short of the last row, which must run to give logits."""
    from ragcache.engine.prefix_cache import PrefixCache

    kv = lambda n: torch.zeros(1, 1, n, 2)  # noqa: E731
    cache = PrefixCache(piece=4)
    cache.insert(torch.arange(10), kv(10), kv(10), torch.ones(3))
    cache.insert(torch.arange(9), kv(9), kv(9), torch.full((3,), 2.0))
    repeat = cache.find(torch.arange(9))
    assert repeat.reused == 9 and torch.equal(repeat.logits, torch.full((3,), 2.0))
    assert (cache.find(torch.arange(12)).reused, cache.find(torch.arange(12)).logits) == (8, None)
    assert cache.find(torch.arange(8)).reused == 4  # 8 in common, the last row runs: one whole piece
    assert PrefixCache().find(torch.arange(9)).logits is None  # no piece: no logits kept, no repeat
    unpieced = PrefixCache()
    unpieced.insert(torch.arange(10), kv(10), kv(10), torch.ones(3))
    assert (unpieced.find(torch.arange(10)).reused, unpieced.find(torch.arange(10)).logits) == (9, None)
    # the same prompt again (no piece: every repeat runs its last row and comes back) is the one held, made the most
    # recently used, not a second copy of its K/V made to replace the first
    held = next(iter(unpieced._prompts.values()))
    unpieced.insert(torch.arange(4) + 50, kv(4), kv(4))
    unpieced.insert(torch.arange(10), kv(10) + 1, kv(10) + 1, torch.ones(3))
    assert list(unpieced._prompts.values())[-1] is held and len(unpieced._prompts) == 2
    # one kept without logits gives way to the same prompt with them, where they are kept
    cache.insert(torch.arange(20), kv(20), kv(20))
    cache.insert(torch.arange(20), kv(20), kv(20), torch.ones(3))
    assert cache.find(torch.arange(20)).reused == 20


def test_the_prefix_caches_are_bounded_and_the_operator_sets_the_bound(monkeypatch):
    """Exact-prefix KV is kept least recently used first out within its budget (each `prefix` request of a new prompt
    adds its whole cache), and RAGCACHE_PREFIX_CACHE_MIB reaches the engine the CLI and the server open."""
    from ragcache.api import server
    from types import SimpleNamespace

    from ragcache import cli
    from ragcache.engine.prefix_cache import PrefixCache
    from ragcache.settings import DEFAULT_PREFIX_BUDGET
    from ragcache.settings import Settings

    prompt = torch.zeros(2, 1, 8, 4)  # 256 bytes of keys, as much of values
    cache = PrefixCache(budget_bytes=3 * 2 * prompt.nbytes)
    for first in range(5):
        cache.insert(torch.tensor([first, 7, 7]), prompt, prompt)
    assert cache._bytes <= cache.budget_bytes and [cache.lookup(torch.tensor([f, 7, 7]))[0] for f in range(5)] == \
        [0, 0, 3, 3, 3]
    opened = []
    monkeypatch.setattr("ragcache.facade.RagCache.from_config", lambda config: opened.append(config) or
                        SimpleNamespace(warmup=lambda: None))
    monkeypatch.setenv("RAGCACHE_PREFIX_CACHE_MIB", "64")
    cli._open("smollm2-135m", "memory:")
    assert opened[-1].prefix_cache_bytes == 64 << 20 and DEFAULT_PREFIX_BUDGET == 256 << 20
    server.open_engine(Settings(store="memory:"))
    assert len(opened) == 2 and opened[-1].prefix_cache_bytes == 64 << 20


def test_a_prompt_the_prefix_cache_cannot_hold_is_not_copied_and_a_copy_out_of_memory_fails_nothing(monkeypatch):
    """A `prefix` prompt past the budget was cloned whole (a GiB at 8k tokens of an 8B model) and then dropped, on
    the model thread, for every request; out of device memory in that copy failed a request whose link was done."""
    from ragcache.engine.prefix_cache import PrefixCache

    prompt = torch.zeros(2, 1, 8, 4)
    cloned = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: cloned.append(t.shape) or real_clone(t, *a, **k))
    small = PrefixCache(budget_bytes=prompt.nbytes)  # keys and values together are twice that
    small.insert(torch.arange(8), prompt, prompt)
    assert cloned == [] and small.usage == (0, 0)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch.Tensor, "clone", out_of_memory)
    roomy = PrefixCache()
    roomy.insert(torch.arange(8), prompt, prompt)  # logged, not raised
    assert roomy.usage == (0, 0)


def test_settings_refuse_what_would_fail_every_request_at_start():
    """A default every request falls back on must be one a request could ask for: else each request that leaves it
    out is refused as the client's error."""
    from ragcache.settings import Settings

    with pytest.raises(errors.UnknownAlgorithm, match="unknown algorithm 'fokus'"):
        RagCache.from_settings(Settings(algorithm="fokus", model="no-such-model"))  # refused before any model loads
    with pytest.raises(ValueError, match="above max_new_tokens_limit"):
        Settings(max_new_tokens=2000, max_new_tokens_limit=1024)
    assert Settings(max_new_tokens=2000, max_new_tokens_limit=4096).max_new_tokens == 2000
    with pytest.raises(ValueError, match=r"chat_max_new_tokens \(2048\) is above max_new_tokens_limit \(1024\)"):
        Settings(chat_max_new_tokens=2048)  # every chat naming no max_tokens would be refused
    assert Settings(chat_max_new_tokens=1024).chat_max_new_tokens == 1024


@pytest.mark.parametrize("rest_of_step_s", [0.0, 0.2])
def test_a_request_cancelled_while_its_raw_texts_compile_stops_their_compiles(monkeypatch, rest_of_step_s):
    """A client that leaves while its raw documents are compiled: the compiles not finished by then are aborted, not
    run for nobody (they take the model's steps), what finished is stored, and the stream ends as cancelled, not as
    an error. Steps of 8 rows: a chunk takes several, so most are unfinished when the first ends. With the rest of
    the step slow and the cancel polled often (a loaded machine), the cancel is seen before the finished compile's
    Done is posted: what finished is stored all the same."""
    if rest_of_step_s:
        monkeypatch.setattr(sequence, "CANCEL_POLL_S", 0.001)
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32, row_budget=8))
    text = " ".join(f"Sentence {n} of a raw document." for n in range(12))
    query = rc.validate("What is it?", [{"text": text}], link=rc.params("naive"), sampling=Sampling(2))
    stream = rc.stream_query(query)
    compiled, make_entry = [], rc.compiler.entry

    def first_then_gone(*args):
        compiled.append(args)
        stream.cancel()  # the client went away as the first chunk's compile ended
        time.sleep(rest_of_step_s)
        return make_entry(*args)

    monkeypatch.setattr(rc.compiler, "entry", first_then_gone)
    events = []
    stream.open(events.append)
    chunks = len(rc.catalog.draft(text).chunks)
    assert events == [Aborted()] and stream.status is Status.ABORTED
    assert 1 <= len(compiled) < chunks, (len(compiled), chunks)
    assert len(list(rc.store.keys())) == len(compiled)  # what was compiled before the cancel was kept
    rc.close()


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_our_calls_of_transformers_raise_no_deprecation_warning(family):
    """Compile, every kind of link and decode on each family: a deprecated argument in our own calls (a layer's
    `past_key_values`, renamed `cache` in transformers 5.24 and removed in 5.40) warns once per call and breaks
    the day the old name goes."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc = RagCache(tiny.make(family), MemoryStore(), EngineConfig(chunk_tokens=24, row_budget=16))
        ids = rc.compile(["The Eiffel Tower is in Paris. It was completed in 1889.", "Rivers flow to the sea."])
        for algorithm in ("focus", "cacheblend", "full", "prefix"):
            rc.query("Where is it?", ids, algorithm=algorithm, max_new_tokens=3)
        rc.driver.stop()
    deprecations = [w for w in seen if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    assert not deprecations, [f"{w.filename}:{w.lineno}: {w.message}" for w in deprecations]


def test_row_budgets_by_device_and_as_given():
    """A GPU step costs its launches: longer steps while no stream decodes; one given row_budget sets both."""
    from ragcache.facade import _row_budgets

    assert _row_budgets(EngineConfig(), "cpu") == (512, 512)
    assert _row_budgets(EngineConfig(), torch.device("cuda", 1)) == (8192, 32768)
    assert _row_budgets(EngineConfig(row_budget=1024), "cuda") == (1024, 1024)
    assert _row_budgets(EngineConfig(link_row_budget=4096), "cuda") == (8192, 4096)
    for bad in (dict(row_budget=0), dict(link_row_budget=-1)):
        with pytest.raises(errors.ParameterOutOfRange, match="at least 1 row"):
            _row_budgets(EngineConfig(**bad), "cpu")


def test_an_open_engine_takes_new_row_budgets_from_its_next_step(monkeypatch):
    """RagCache.set_row_budgets (what bench/gpu.py sweeps on one engine): EngineConfig's meaning and checks, applied
    between steps; batch-invariant, link_row_budget is row_budget's and the prefix cache, emptied, cuts at it."""
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32, batch_invariant=False))
    ids = rc.compile([DOC])

    def link_steps() -> tuple[int, int]:
        before = rc.step_stats()
        prompt = len(rc.link("How tall is it?", ids, algorithm="full").token_ids)
        return rc.step_stats().steps - before.steps, prompt

    assert rc.row_budgets == (512, 512) and link_steps()[0] == 2  # its place, then one piece
    rc.set_row_budgets(8, 16)
    steps, prompt = link_steps()
    assert rc.row_budgets == (8, 16) and steps == 1 + -(-prompt // 16) and prompt > 16
    rc.set_row_budgets(32)  # link_row_budget follows a given row_budget, as in EngineConfig
    assert rc.row_budgets == (32, 32)
    rc.set_row_budgets()
    assert rc.row_budgets == (512, 512)
    with pytest.raises(errors.ParameterOutOfRange, match="at least 1 row"):
        rc.set_row_budgets(0)
    assert rc.row_budgets == (512, 512)
    rc.close()

    for cut_invariant in (False, True):  # a prompt's bits depend on the budget it was cut at, or on no cut
        monkeypatch.setattr("ragcache.engine.invariant.cuts_alike", lambda *shape: cut_invariant)
        invariant = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32, batch_invariant=True))
        ids = invariant.compile([DOC])
        invariant.link("How tall is it?", ids, algorithm="prefix")
        assert invariant.prefix_cache.lookup(invariant.prompt_parts("How tall is it?", ids).token_ids)[1] is not None
        invariant.set_row_budgets(8, 16)
        assert invariant.row_budgets == (8, 8) and invariant.prefix_cache.piece == (1 if cut_invariant else 8)
        kept = invariant.prefix_cache.lookup(invariant.prompt_parts("How tall is it?", ids).token_ids)[1]
        assert (kept is not None) == cut_invariant  # cut anywhere, the cached rows stay what a cold prompt computes
        invariant.close()


def test_step_stats_model_work_and_close_go_through_the_model_thread():
    """What bench/ reads and runs on an engine: a copy of the step counters (reset: from zero after it), fn(runner)
    on the model thread, and close, after which the engine answers nothing."""
    import threading

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32))
    ids = rc.compile([DOC])
    rc.query("How tall is it?", ids, max_new_tokens=4)
    taken = rc.step_stats(reset=True)
    assert taken.steps > 0 and taken.decode_rows > 0 and taken.longest_decode_step_s > 0
    assert rc.step_stats().steps == 0 and rc.step_stats().longest_decode_step_s == 0.0
    taken.steps = -1  # a copy: the engine's counters are its own
    assert rc.step_stats().steps == 0
    assert rc.with_runner(lambda runner, x: (runner is rc.runner, threading.current_thread().name, x), 7) == (
        True, "ragcache-model", 7)
    assert rc.shape == rc.runner.shape and rc.shape.layers == rc.layers
    # a NARROW step (cacheblend's link, all its rows in one forward of its own) counts its rows as link rows
    blended = rc.query("How tall is it?", ids, algorithm="cacheblend", max_new_tokens=1).stats
    assert rc.step_stats(reset=True).link_rows >= blended.recomputed_tokens > 0  # its first layers run every row
    rc.close()
    with pytest.raises(errors.ShuttingDown):
        rc.query("How tall is it?", ids, max_new_tokens=4)


def test_the_longest_wait_of_a_decoding_stream_counts_the_steps_it_is_not_in():
    """A PLACE or NARROW step beside a decoding stream keeps it waiting as a forward step would; the longest wait
    counted only steps with decode rows."""
    from ragcache.engine.driver import StepStats
    from ragcache.engine.scheduler import Kind, StepPlan

    stats = StepStats()
    stats.count(StepPlan(Kind.NARROW), 2.0, decoding=True, narrowed=30)
    stats.count(StepPlan(Kind.PLACE), 3.0)  # nothing decoding: nobody waited
    assert (stats.longest_decode_step_s, stats.link_rows, stats.steps) == (2.0, 30, 2)


def test_a_links_recompute_time_leaves_out_its_placing(rc, monkeypatch):
    """rotate_s and recompute_s are two phases of one link: the time placing took (linker.plan's rotate_s) was
    counted in recompute_s too, so the two summed past the link's own time."""
    from ragcache import linker

    plan = linker.plan

    def slow_placing(*args, **kwargs):
        p = plan(*args, **kwargs)
        time.sleep(0.5)  # placing that took half a second, as plan measured it
        p.rotate_s += 0.5
        return p

    monkeypatch.setattr(linker, "plan", slow_placing)
    ids = rc.compile(tiny.CORPUS[:2])
    stats = rc.query("Where is it?", ids, algorithm="naive", max_new_tokens=1).stats
    assert stats.rotate_s >= 0.5 and stats.recompute_s < 0.4


def test_focus_pre_pass_is_recompute_time_not_rotation(rc, monkeypatch):
    """focus runs the question through the model to rank the chunk rows: that forward is recompute time; rotate_s
    (placing: gather and RoPE) counted it."""
    from ragcache import linker

    question_attention = linker.question_attention

    def slow_pre_pass(*args, **kwargs):
        time.sleep(0.5)
        return question_attention(*args, **kwargs)

    monkeypatch.setattr(linker, "question_attention", slow_pre_pass)
    ids = rc.compile(tiny.CORPUS[:2])
    stats = rc.query("Where is it?", ids, algorithm="focus", max_new_tokens=1).stats
    assert stats.rotate_s < 0.4 and stats.recompute_s >= 0.5


def test_a_model_thread_ended_by_a_base_exception_fails_its_requests_and_the_next_one_starts(monkeypatch):
    """Something past the contained exceptions (a BaseExceptionGroup, GeneratorExit) ended the model thread with
    `_thread` still set: its requests and every later one waited forever."""
    import threading

    class Stop(BaseException):
        pass

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32))
    ids = rc.compile(tiny.CORPUS[:2])
    forward, raised = rc.runner.forward, []

    def once(*args, **kwargs):  # in a step of the request, once it is scheduled
        if not raised:
            raised.append(True)
            raise Stop()
        return forward(*args, **kwargs)

    monkeypatch.setattr(rc.runner, "forward", once)
    outcome = []

    def ask():
        try:
            outcome.append(rc.query("Where is it?", ids, algorithm="naive", max_new_tokens=2))
        except Exception as exc:  # noqa: BLE001 - what the caller gets
            outcome.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(60)
    assert outcome and isinstance(outcome[0], RuntimeError) and "model thread stopped" in str(outcome[0])
    assert rc.query("Where is it?", ids, algorithm="naive", max_new_tokens=2).text is not None


def test_a_stream_the_pool_cannot_grow_for_fails_alone(monkeypatch):
    """A pool that cannot grow for a stream starting to decode (out of memory) failed the whole step: every stream
    decoding in it. It fails that stream only; the pool is as it was for the others."""
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32))
    ids = rc.compile(tiny.CORPUS[:2])
    first = rc.stream("Where is it?", ids, algorithm="naive", max_new_tokens=400)  # long: it is still decoding
    pieces = iter(first)
    next(pieces)  # its first token is out: its first decode step, which puts it in the pool, may not have run yet
    deadline = time.monotonic() + 60
    while (first.cache is None or first.cache.slot is None) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert first.cache.slot is not None  # decoding, in the pool
    adopt = rc.runner.pool.adopt

    def out_of_memory(cache):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(rc.runner.pool, "adopt", out_of_memory)
    second = rc.stream("What is it?", ids, algorithm="naive", max_new_tokens=4)
    with pytest.raises(RuntimeError, match="out of memory"):
        for _ in second:
            pass
    monkeypatch.setattr(rc.runner.pool, "adopt", adopt)
    for _ in pieces:
        pass
    assert first.answer.stats.completion_tokens == 400
    rc.close()


def test_a_failure_handed_over_keeps_nothing_its_frames_held():
    """The frames in a failed request's traceback held its joined cache, a step's activations or every record it
    named; an error re-raised where its event is a local makes a cycle that kept them until the cycle collector ran
    (rarely, under load)."""
    import gc
    import weakref

    from ragcache.engine.sequence import Failed

    def fails():
        held = torch.zeros(1024)  # what a failed step held
        ref.append(weakref.ref(held))
        raise RuntimeError("the step failed")

    ref = []
    gc.disable()
    try:
        try:
            fails()
        except RuntimeError as exc:
            event = Failed(exc)
        cycle = {"event": event}
        cycle["self"] = cycle  # kept by a cycle, as a route's frame holding its event would
        assert ref[0]() is None  # freed at once: no collector needed
        assert "the step failed" in "".join(__import__("traceback").format_exception(event.error))  # still logs
    finally:
        gc.enable()


def test_a_failed_link_frees_its_cache(rc, monkeypatch):
    """A link-only sequence that failed kept its cache from the pool: nobody would ever take it."""
    from ragcache.engine import driver as driver_module
    from ragcache.engine.sequence import Status

    spent = []
    real = driver_module.Driver._free

    def watched(self, sequence, status):
        cache = sequence.cache
        real(self, sequence, status)
        if cache is not None and status is Status.FAILED:
            spent.append(cache.capacity)

    monkeypatch.setattr(driver_module.Driver, "_free", watched)
    monkeypatch.setattr(rc.runner, "logits", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no logits")))
    with pytest.raises(Exception):
        rc.link("where?", [{"text": DOC}], algorithm="full")
    assert spent == [0], spent  # spent: no K/V left in it


def test_top_p_draws_only_from_the_nucleus():
    """The smallest set of top tokens whose mass reaches top_p: here the first alone at 0.5, the first two at 0.8;
    the draw's generator makes it repeatable."""
    from ragcache.engine.sampling import draw

    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    for top_p, allowed in ((0.5, {0}), (0.8, {0, 1}), (1.0, {0, 1, 2, 3})):
        g = torch.Generator().manual_seed(0)
        seen = {int(draw(logits, Sampling(temperature=1.0, top_p=top_p), g)) for _ in range(400)}
        assert seen == allowed, (top_p, seen)
    # top_p 0 (what OpenAI's clients send for determinism): the most likely token, drawing nothing from the seed
    g = torch.Generator().manual_seed(0)
    assert {int(draw(logits, Sampling(temperature=1.0, top_p=0.0), g)) for _ in range(50)} == {0}
    assert Sampling(temperature=1.0, top_p=0.0).greedy and g.initial_seed() == 0 and torch.equal(
        g.get_state(), torch.Generator().manual_seed(0).get_state())
    again = [int(draw(logits, Sampling(temperature=1.0), torch.Generator().manual_seed(5))) for _ in range(2)]
    assert again[0] == again[1] and draw(logits, Sampling(), None).shape == (1,)


def test_a_store_url_it_cannot_read_fails_before_the_model_loads_and_an_engine_that_fails_closes_its_store(
    monkeypatch, tmp_path
):
    """`disk:...?size=20GB` (GB, not GiB) failed after minutes of loading, as an error of the store (exit 1), not
    bad input (exit 3); an engine that failed to start left the store it had opened open."""
    from ragcache import models
    from ragcache.errors import BadRequest
    from ragcache.settings import EngineConfig
    from ragcache.store import disk

    loads, closed = [], []
    monkeypatch.setattr(models, "load", lambda *a, **k: loads.append(a) or tiny.make("llama"))
    for url in (f"disk:{tmp_path}?size=20GB", "memory:16GB", "gpu:lots"):
        with pytest.raises(BadRequest, match="size|budget"):
            RagCache.from_config(EngineConfig("smollm2-135m", url))
    assert loads == []

    def broken(self, *args, **kwargs):
        raise RuntimeError("the engine cannot start")

    monkeypatch.setattr(disk.DiskStore, "close", lambda self: closed.append(self))
    monkeypatch.setattr(RagCache, "__init__", broken)
    with pytest.raises(RuntimeError, match="cannot start"):
        RagCache.from_config(EngineConfig("smollm2-135m", f"disk:{tmp_path}"))
    assert len(loads) == 1 and len(closed) == 1


def test_a_closed_engine_refuses_its_methods_instead_of_reopening_its_store(tmp_path):
    """After close(), a compile of a new text wrote its document record (the disk tier reopened underneath) and then
    failed with the server's "send the request again to another server"; listing went on working."""
    from ragcache.errors import EngineClosed
    from ragcache.store import open_store

    with RagCache(tiny.make("llama"), open_store(f"disk:{tmp_path}"), EngineConfig(chunk_tokens=24)) as rc:
        rc.compile(["A first text."])
    assert rc._closed  # the with-block closed it
    for call in (lambda: rc.compile(["A new text."]), rc.document_ids, lambda: rc.query("Why?", docs=[{"text": "x"}])):
        with pytest.raises(EngineClosed, match="the engine is closed"):
            call()
    assert len(open_store(f"disk:{tmp_path}").record_names("doc/")) == 1


def test_a_chunk_budget_whose_chunks_outgrow_the_context_is_said_at_open(monkeypatch, caplog):
    """A chunk takes up to twice its budget (to a sentence end): with a budget past half the context, a query over
    a document holding such a chunk is refused (PromptTooLong) after its compile stored it; said as the engine opens,
    with the budget that fits."""
    from ragcache import models
    from ragcache.settings import EngineConfig

    monkeypatch.setattr(models, "load", lambda *a, **k: tiny.make("llama"))  # a context of 512
    for budget, said in ((300, True), (200, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="ragcache"):
            RagCache.from_config(EngineConfig("tiny", "memory:", chunk_tokens=budget)).close()
        assert ("chunk_tokens 300 lets a chunk reach 60" in caplog.text and "at most 255" in caplog.text) is said
