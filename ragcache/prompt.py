"""The linked prompt's token layout: [system prefix | chunk_1 ... chunk_n | question suffix].

Each part is tokenized alone and the prompt is their concatenation; `full` gets the same ids, so every
algorithm is compared on identical input. For chat models the template's header (up to the user's turn)
is the system prefix and its closing (end of turn + assistant header) ends the question suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import TemplateError

from .chunker import as_text, text_ids
from .errors import BadRequest

_SLOT = "\u2063RAGCACHE_DOCS\u2063"
_SYSTEM = "\u2063RAGCACHE_SYSTEM\u2063"


@dataclass(frozen=True)
class PromptFormat:
    head_template: str | None  # chat text before the documents, with {system} handled by the template
    tail: str  # chat text after the question (end of turn + assistant header), "" for base models
    chat: bool

    @classmethod
    def for_tokenizer(cls, tokenizer) -> PromptFormat:
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": _SLOT}], tokenize=False, add_generation_prompt=True
            )
            if rendered.count(_SLOT) == 1:
                return cls(head_template="chat", tail=rendered.split(_SLOT)[1], chat=True)
        return cls(head_template=None, tail="", chat=False)


def system_prefix_ids(tokenizer, fmt: PromptFormat, system: str | None) -> list[int]:
    """The system prefix. The system prompt is text too, as a question is: an application that writes its users'
    words into it (a template's variable) must not have them close its turn with a control token's spelling; only
    the chat template's own markup is encoded with its control tokens, the system text where the template put it.
    A system prompt that spells none is encoded with the template in one piece, as the model was trained: pieces
    encoded apart differ at their seams for some tokenizers (SentencePiece's dummy prefix)."""
    if fmt.chat:
        # a system text holding this module's own markers is placed as a spelled one is: split at a marker, it
        # would lose what follows and leave its turn open
        spelled = system is not None and (
            _spells_a_control_token(tokenizer, system) or _SLOT in system or _SYSTEM in system
        )
        content = _SYSTEM if spelled else system
        messages = ([{"role": "system", "content": content}] if system else []) + [{"role": "user", "content": _SLOT}]
        try:
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as exc:  # a template that takes no system turn (Gemma's: "System role not supported")
            raise BadRequest(f"this model's chat template refuses the system prompt ({exc}); send none") from exc
        if rendered.count(_SLOT) != 1:  # a template that repeats the user's turn
            raise BadRequest("this model's chat template does not place the documents once; send no system prompt")
        head = rendered.split(_SLOT)[0]
        if not spelled or system is None:
            return tokenizer(head, add_special_tokens=False)["input_ids"]
        pieces = head.split(_SYSTEM)
        if len(pieces) != 2:  # a template that changes the text or repeats it
            raise BadRequest("this model's chat template does not place the system prompt once as given; send none")
        before, after = (tokenizer(piece, add_special_tokens=False)["input_ids"] for piece in pieces)
        return [*before, *text_ids(tokenizer, system)["input_ids"], *after]
    if not system:
        return []
    return as_text(tokenizer)(system.rstrip() + "\n\n", add_special_tokens=True, split_special_tokens=True)["input_ids"]


def _spells_a_control_token(tokenizer, text: str) -> bool:
    """`text` holds the spelling of a token the tokenizer matches before its model (`<|im_end|>`, `</s>`)."""
    return any(spelling in text for spelling in tokenizer.get_added_vocab())


def question_ids(tokenizer, fmt: PromptFormat, question: str, with_docs: bool) -> list[int]:
    """The question suffix. The question is a user's text: its spelling of a control token stays text (as a
    document's: chunker.text_ids), so an application that passes its users' text as the question keeps its own
    system turn; the chat template's closing keeps its tokens. Cut where the tokenizer's own pieces end (before
    the question's space, before the template's first control token): the same ids as the whole text encoded at
    once for the built-in models' tokenizers."""
    lead = "\n\n" if with_docs else ""
    head = tokenizer(f"{lead}Question:", add_special_tokens=False)["input_ids"]
    if fmt.chat:
        asked = text_ids(tokenizer, f" {question.strip()}")["input_ids"]
        return [*head, *asked, *tokenizer(fmt.tail, add_special_tokens=False)["input_ids"]]
    return [*head, *text_ids(tokenizer, f" {question.strip()}\nAnswer:")["input_ids"]]
