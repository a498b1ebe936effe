"""Streaming an answer's text: decoding the whole answer at every token (before) against a window of the last ids
(after, TextAssembler), on SmolLM2's tokenizer, answers of 256, 1024 and 4096 tokens drawn from real text. Prints
the milliseconds per token of each and the commit. `python -m research.detok_window`."""

import statistics
import subprocess
import time

from transformers import AutoTokenizer

from ragcache import models
from ragcache.engine.sampling import TextAssembler
from ragcache.settings import DATA_DIR


class Whole(TextAssembler):
    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def ms_per_token(kind, tok, ids) -> float:
    runs = []
    for _ in range(3):
        asm = kind(tok, ["###"])
        t = time.perf_counter()
        for i in ids:
            asm.push(i)
        runs.append((time.perf_counter() - t) / len(ids) * 1e3)
    return statistics.median(runs)


def main() -> None:
    tok = AutoTokenizer.from_pretrained(models.resolve("smollm2-135m"))
    text = " ".join(p.read_text() for p in sorted(DATA_DIR.glob("docs/*.txt")))
    ids = tok(text * 20, add_special_tokens=False)["input_ids"]
    for n in (256, 1024, 4096):
        whole, window = ms_per_token(Whole, tok, ids[:n]), ms_per_token(TextAssembler, tok, ids[:n])
        print(f"{n} tokens: whole {whole:.3f} ms/token, window {window:.3f} ms/token, {whole / window:.1f}x", flush=True)
    print(subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
