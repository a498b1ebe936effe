"""Talk to a running ragcache server (start one with `ragcache serve`): upload documents, ask a question, stream an
answer over server-sent events, and ask through the official `openai` client.

    pip install httpx openai                                    # the clients (not ragcache's dependencies)
    python examples/rest_client.py                              # http://127.0.0.1:8000, ragcache/data/docs/*.txt
    python examples/rest_client.py --url http://host:8000 --api-key KEY --docs a.txt b.txt --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
from openai import OpenAI

from ragcache.settings import DATA_DIR

DOCS = sorted((DATA_DIR / "docs").glob("*.txt"))
QUESTION = "How tall is the Harrow Point lighthouse?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--api-key", default=None, help="bearer token, when the server sets one")
    parser.add_argument("--docs", nargs="+", type=Path, default=DOCS, help="text files to upload")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--algorithm", default="focus")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    http = httpx.Client(base_url=args.url, headers=headers, timeout=600)

    # 1. upload: every document is compiled into KV caches once (already stored ones are skipped)
    docs = [{"text": p.read_text(), "metadata": {"source": p.name}} for p in args.docs]
    uploaded = http.post("/v1/documents", json={"documents": docs})
    uploaded.raise_for_status()
    ids = uploaded.json()["ids"]
    print(f"uploaded {len(ids)} documents: {uploaded.json()['stats']}")

    # 2. ask: the cached chunks are linked, only a few tokens per chunk are recomputed
    body = {"question": args.question, "documents": ids, "algorithm": args.algorithm, "max_tokens": args.max_tokens}
    reply = http.post("/v1/query", json=body)
    reply.raise_for_status()
    result = reply.json()
    print(f"\n/v1/query: {result['answer']!r}")
    print(f"  usage {result['usage']}\n  ttft {result['timings']['ttft_s'] * 1000:.0f} ms")

    # 3. stream: server-sent events, one {"text": ...} per piece, then the full response, then [DONE]
    print("\n/v1/query, streamed: ", end="", flush=True)
    with http.stream("POST", "/v1/query", json={**body, "stream": True}) as events:
        events.raise_for_status()
        for line in events.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "text" in event:
                print(event["text"], end="", flush=True)
            elif "usage" in event:
                print(f"\n  finish_reason {event['finish_reason']}, usage {event['usage']}")

    # 4. the official OpenAI client: documents and link options travel in extra_body
    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key or "unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, max_tokens=args.max_tokens, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly from the documents."},
                  {"role": "user", "content": args.question}],
        extra_body={"documents": ids, "ragcache": {"algorithm": args.algorithm}})
    print(f"\nopenai chat ({model}): {chat.choices[0].message.content!r}")
    print(f"  cached prompt tokens {chat.usage.prompt_tokens_details.cached_tokens} of {chat.usage.prompt_tokens}")


if __name__ == "__main__":
    main()
