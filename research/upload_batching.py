"""Uploads compiled together: 32 short documents compiled one call each (a REST upload, one call a document, before
this change) against one call (after), alternated in one process. `python -m research.upload_batching`; prints the
tokens/s of each and the commit."""

import random
import statistics
import subprocess
import time
import uuid

from ragcache import models
from ragcache.facade import RagCache
from ragcache.store import open_store


def main() -> None:
    lm = models.load("smollm2-135m")
    words = "harbour lighthouse keeper storm ledger island ferry granite beacon tide chart season".split()
    rc = RagCache(lm, open_store("memory"))
    rc.warmup()
    res = {"each": [], "together": []}
    for run in range(6):
        for mode in ("each", "together") if run % 2 == 0 else ("together", "each"):
            rng = random.Random()
            texts = [
                f"Document {i}. " + " ".join(rng.choice(words) for _ in range(110)) + uuid.uuid4().hex
                for i in range(32)
            ]
            t = time.perf_counter()
            if mode == "each":
                tokens = sum(rc.compile_documents([x]).compiled_tokens for x in texts)
            else:
                tokens = rc.compile_documents(texts).compiled_tokens
            dt = time.perf_counter() - t
            res[mode].append(tokens / dt)
            print(run, mode, f"{dt:.2f}s {tokens / dt:,.0f} tok/s", flush=True)
    print(
        {k: round(statistics.median(v)) for k, v in res.items()},
        subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout,
    )


if __name__ == "__main__":
    main()
