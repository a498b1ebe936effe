"""ragcache in 20 lines: compile documents once, then answer by linking their caches (focus).

    python examples/quickstart.py [STORE]      # STORE defaults to disk:./.ragcache (the one `make demo` fills)
"""

import sys

from ragcache import RagCache
from ragcache.settings import DATA_DIR

store = sys.argv[1] if len(sys.argv) > 1 else "disk:./.ragcache"
docs = DATA_DIR / "docs"

rc = RagCache.open(model="smollm2-135m", store=store)
ids = rc.compile([(docs / name).read_text() for name in ("lighthouse.txt", "railway.txt", "bridge.txt")])

answer = rc.query("How tall is the Harrow Point lighthouse?", docs=ids, max_new_tokens=32,
                  stop=["\n\n"])  # linked with focus, the default
st = answer.stats
print(answer.text.strip())
print(f"TTFT {st.ttft_s * 1000:.0f} ms | {st.cached_tokens} cached + {st.recomputed_tokens} recomputed tokens "
      f"of {st.prompt_tokens} | store hits {st.store_hits}, compiled {st.compiled_chunks}")
