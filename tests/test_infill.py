"""EFIM infilling: prompt builders, sessions that reuse their cache across rounds, bad input."""

import pytest

from ragcache import errors
from ragcache.facade import RagCache
from ragcache.infill import MAX_INCREMENT_CHARS, FimTokens, InfillSessions, build_prompt, end_token_ids
from ragcache.store.memory import MemoryStore
from tests import tiny

PRE, SUF, MID = 3, 4, 5  # ids of <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> in the tiny tokenizer


@pytest.fixture(scope="module")
def rc():
    return RagCache(tiny.make("qwen2"), MemoryStore())


def ids(text):
    return tiny.tokenizer()(text, add_special_tokens=False)["input_ids"]


def test_sentinels_are_found():
    tok = tiny.tokenizer()
    assert FimTokens.for_tokenizer(tok) == FimTokens(PRE, SUF, MID, lead=(tok.bos_token_id,))


def test_prompt_layouts_by_hand():
    tok, fim = tiny.tokenizer(), FimTokens(PRE, SUF, MID)
    a, b, c = tok.convert_tokens_to_ids(["a", "b", "c"])
    assert build_prompt(tok, fim, "a", "b", "psm") == [PRE, a, SUF, b, MID]
    assert build_prompt(tok, fim, "a", "b", "spm") == [PRE, SUF, b, MID, a]  # the FIM paper's SPM, as StarCoder's
    assert build_prompt(tok, fim, "a", "b", "efim") == [PRE, a, SUF, b, MID]
    assert build_prompt(tok, fim, "ac", "b", "efim", split=1) == [PRE, a, SUF, b, MID, c]  # increment after <MID>
    assert build_prompt(tok, fim, "", "", "efim") == [PRE, SUF, MID]


def rounds(sessions: InfillSessions):
    """`plan` and then `remember`, as a round the engine takes does."""

    def round_(session, prefix, suffix, mode):
        split = sessions.plan(session, prefix, suffix, mode)
        sessions.remember(session, prefix, suffix, mode, split)
        return split

    return round_


def test_sessions_keep_their_base_while_the_prefix_grows():
    sessions = InfillSessions()
    plan = rounds(sessions)
    assert plan("s", "def f(", ")", "efim") == len("def f(")
    assert plan("s", "def f(x", ")", "efim") == len("def f(")
    assert plan("s", "def f(x, y", ")", "efim") == len("def f(")
    assert plan("s", "def f(x, y", "):", "efim") == len("def f(x, y")  # suffix changed: new base
    assert plan("s", "class", "):", "efim") == len("class")  # prefix no longer extends the base
    assert plan(None, "abc", "", "efim") == 3
    # a round only planned (refused as too long) leaves the base where it was
    assert sessions.plan("s", "class Foo" + "o" * 40, "):", "efim") == len("class Foo" + "o" * 40)
    assert plan("s", "class F", "):", "efim") == len("class")


def test_deepseek_coders_sentinels_are_found_and_its_prompts_begin_with_its_bos():
    """DeepSeek-Coder spells its sentinels with fullwidth bars (U+FF5C); an ASCII '|' spelling refused the model.
    Its tokenizer puts BOS before any text, and its FIM prompts were trained behind it."""

    class Vocab:
        bos_token_id = 32013

        def get_vocab(self):
            return {"<\uff5cfim\u2581begin\uff5c>": 32016, "<\uff5cfim\u2581hole\uff5c>": 32015,
                    "<\uff5cfim\u2581end\uff5c>": 32017, "<\uff5cend\u2581of\u2581sentence\uff5c>": 32014}

        def __call__(self, text, add_special_tokens=True, **options):
            return {"input_ids": [32013] * add_special_tokens + [ord(c) for c in text]}

    fim = FimTokens.for_tokenizer(Vocab())
    assert fim == FimTokens(32016, 32015, 32017, lead=(32013,))
    assert end_token_ids(Vocab()) == {32014}
    assert build_prompt(Vocab(), fim, "a", "b", "psm") == [32013, 32016, ord("a"), 32015, ord("b"), 32017]


def test_a_tokenizer_without_bos_gets_none_before_its_fim_prompt():
    """Qwen2.5-Coder and StarCoder put nothing before text: nor does their FIM prompt."""
    import copy

    tok = copy.deepcopy(tiny.tokenizer())  # (the shared one adds BOS)
    tok.add_bos_token = False  # transformers' switch for whether the tokenizer puts BOS before text
    tok._tokenizer.post_processor = None
    assert tok("a")["input_ids"][0] != tok.bos_token_id
    fim = FimTokens.for_tokenizer(tok)
    assert fim.lead == () and build_prompt(tok, fim, "a", "b", "psm")[0] == PRE


def test_a_sessions_base_moves_up_once_the_typed_increment_is_long():
    """The increment after <MID> stays within what a model is taught (MAX_INCREMENT_CHARS): a session begun on an
    empty file does not put every character typed since after <MID>."""
    sessions = InfillSessions()
    plan = rounds(sessions)
    assert plan("s", "", "", "efim") == 0
    typed = "x" * MAX_INCREMENT_CHARS
    assert plan("s", typed, "", "efim") == 0  # the whole increment still fits
    assert plan("s", typed + "y", "", "efim") == len(typed) + 1  # one more: a new base
    assert plan("s", typed + "yz", "", "efim") == len(typed) + 1


def test_sessions_are_bounded_and_expire():
    sessions = InfillSessions(max_sessions=2, ttl_s=0.0)
    for sid in "abc":
        rounds(sessions)(sid, "x", "y", "efim")
    assert len(sessions) <= 2


def test_sessions_are_bounded_in_characters_too():
    """A session keeps its prefix and suffix, up to two documents' worth: 256 of them held ~100 M characters."""
    sessions = InfillSessions(max_chars=100)
    plan = rounds(sessions)
    for sid in "abc":
        plan(sid, "x" * 40, "y", "efim")
    assert len(sessions) == 2 and sessions.plan("a", "x" * 41, "y", "efim") == 41  # the oldest went: a new base
    assert sessions.plan("c", "x" * 41, "y", "efim") == 40


def test_efim_rounds_reuse_the_base_and_match_a_fresh_prompt(rc):
    prefix0, suffix = "The Eiffel Tower is in Paris. It was ", " metres tall."
    first = rc.infill(prefix0, suffix, session="u1", max_new_tokens=6)
    assert first.stats.cached_tokens == 0
    base = len([tiny.tokenizer().bos_token_id, PRE, *ids(prefix0), SUF, *ids(suffix), MID])  # it adds BOS
    for typed in ("completed", "completed in 1889 and"):  # within MAX_INCREMENT_CHARS of the base
        reused = rc.infill(prefix0 + typed, suffix, session="u1", max_new_tokens=6)
        assert reused.stats.cached_tokens >= base
        assert reused.stats.prompt_tokens == base + len(ids(typed))
        assert reused.stats.recomputed_tokens == reused.stats.prompt_tokens - reused.stats.cached_tokens
        tok = tiny.tokenizer()
        fim = FimTokens.for_tokenizer(tok)
        same_ids = build_prompt(tok, fim, prefix0 + typed, suffix, "efim", split=len(prefix0))
        assert len(same_ids) == reused.stats.prompt_tokens
    # the same EFIM prompt computed from scratch gives the same greedy output
    uncached = RagCache(tiny.make("qwen2"), MemoryStore())
    uncached.infill_sessions.remember("u1", prefix0, suffix, "efim", None)  # same base, nothing cached
    expected = uncached.infill(prefix0 + typed, suffix, session="u1", reuse=False, max_new_tokens=6)
    assert expected.stats.cached_tokens == 0
    assert expected.token_ids == reused.token_ids and expected.text == reused.text


def test_psm_loses_the_suffix_cache_when_the_prefix_grows(rc):
    prefix0, suffix = "Mount Everest lies in the ", " and is the highest mountain on Earth."
    rc.infill(prefix0, suffix, session="p1", mode="psm", max_new_tokens=2)
    grown = rc.infill(prefix0 + "Himalayas", suffix, session="p1", mode="psm", max_new_tokens=2)
    assert grown.stats.cached_tokens <= 1 + len(ids(prefix0))  # everything from the edit on is recomputed
    assert grown.stats.recomputed_tokens >= len(ids(suffix))


def test_infill_bad_input(rc):
    with pytest.raises(errors.EmptyInput):
        rc.infill("", "")
    with pytest.raises(errors.BadRequest, match="unknown infill mode"):
        rc.infill("a", "b", mode="xyz")


def test_model_without_fim_tokens_is_refused(smollm2):
    with pytest.raises(errors.UnsupportedModel, match="fill-in-the-middle"):
        FimTokens.for_tokenizer(smollm2.tokenizer)


def test_a_stop_given_as_one_string_is_one_stop_string(rc, monkeypatch):
    """`infill(stop="\\n\\n")` stopped at any single newline: the string was taken as a list of its characters."""
    seen = []
    monkeypatch.setattr(type(rc), "stream_infill", lambda self, fill: seen.append(fill.sampling.stop))
    rc.infill_stream("def f(", "):", stop="END")
    rc.infill_stream("def f(", "):", stop=["a", "b"])
    assert seen == [["END"], ["a", "b"]]
