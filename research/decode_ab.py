"""1-stream decode A/B (issue 46): ragcache's decode tok/s over transformers' cached loop in the same process
(fp32, 1 thread), so that the machine's drift cancels in the ratio.

Run one commit against another in one sitting, interleaved:
    PYTHONPATH=<checkout of the commit> python research/decode_ab.py TAG
"""
import inspect
import json
import statistics
import sys
import time

import torch
torch.set_num_threads(1)
from ragcache.facade import RagCache
from transformers import DynamicCache

rc = RagCache.open("smollm2-135m", "memory:", dtype="float32", adapter=None)
docs = [" ".join(["The lighthouse keeper watched the ships pass the rocky coast at night."] * 30) for _ in range(2)]
ids = rc.compile(docs)
q = "What did the keeper watch?"
rc.query(q, ids, algorithm="naive", max_new_tokens=4)
ours = []
for _ in range(3):
    a = rc.query(q, ids, algorithm="naive", max_new_tokens=48, temperature=0.0)
    n = a.stats.completion_tokens
    ours.append((n - 1) / a.stats.decode_s)
model = rc.lm.model
name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
prompt = torch.randint(0, 1000, (1, a.stats.prompt_tokens))
theirs = []
with torch.inference_mode():
    for _ in range(3):
        cache = DynamicCache(config=model.config)
        tok = model(prompt, use_cache=True, logits_to_keep=1, **{name: cache}).logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(47):
            tok = model(tok, use_cache=True, **{name: cache}).logits[:, -1:].argmax(-1)
            int(tok)
        theirs.append(47 / (time.perf_counter() - t))
o, t = statistics.median(ours), statistics.median(theirs)
print(json.dumps(dict(tag=sys.argv[1], ours=round(o, 2), transformers=round(t, 2), ratio=round(o / t, 3), prompt=a.stats.prompt_tokens)))
