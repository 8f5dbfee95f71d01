# SPDX-License-Identifier: Apache-2.0
"""Ask a running `vllm serve` for a completion, a streamed chat reply and two PIC requests, then show our metrics.

    python -m vllm_hysparse.tools.demo_client --base-url http://127.0.0.1:8000/v1
    python -m vllm_hysparse.tools.demo_client --questions "What is the capital of France?" "What is 7 times 8?"

`--questions` asks each one as a greedy chat request first (what a real model is shown with);
`--random-weights` says the answers of a random-weight model are not meant to make sense.
"""

import argparse
import sys
import urllib.request

from openai import OpenAI

from vllm_hysparse.tools.harness import wait_until_healthy


def hysparse_metrics(base_url: str) -> list[str]:
    root = base_url.rsplit("/v1", 1)[0]
    with urllib.request.urlopen(f"{root}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [line for line in text.splitlines() if line.startswith("vllm:hysparse_")]


def _totals(lines: list[str]) -> dict[str, float]:
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)}


def _pages(totals: dict[str, float]) -> tuple[float, float, float] | None:
    """(sparse queries, KV pages read per query, pages dense attention reads per query) of counter totals."""
    queries = totals.get("vllm:hysparse_sparse_queries_total", 0.0)
    if not queries:
        return None
    return (queries, totals.get("vllm:hysparse_pages_touched_total", 0.0) / queries,
            totals.get("vllm:hysparse_dense_pages_total", 0.0) / queries)


def pages_per_query(lines: list[str]) -> str | None:
    """One line from the `vllm:hysparse_*` counters: pages read per sparse query against a dense model's."""
    found = _pages(_totals(lines))
    if found is None or not found[2]:
        return None
    queries, pages, dense = found
    return (f"{pages:.2f} KV pages per sparse query, {dense:.2f} for a dense model ({pages / dense:.2f}x) "
            f"over {queries:.0f} (query, KV group) selections")


def long_context_demo(client: OpenAI, model: str, base_url: str, words: int) -> None:
    """One long prompt: the pages its sparse queries read, next to what dense attention would read."""
    facts = [f"Note {i}: the locker numbered {i * 7 % 1000} holds a {c} box." for i, c in
             zip(range(words // 10), ["red", "blue", "green", "black", "white"] * (words // 50 + 1))]
    prompt = "\n".join(facts) + "\nQuestion: what colour is the box in the first locker?\nAnswer:"
    before = _totals(hysparse_metrics(base_url))
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    after = _totals(hysparse_metrics(base_url))
    found = _pages({k: after[k] - before.get(k, 0.0) for k in after})
    if found is not None and found[2]:
        _, pages, dense = found
        print(f"[long context] {out.usage.prompt_tokens}-token prompt -> {out.choices[0].text!r}; its sparse "
              f"queries read {pages:.2f} KV pages each, dense attention {dense:.2f} ({pages / dense:.2f}x)")


def pic_demo(client: OpenAI, model: str) -> None:
    """Two RAG-shaped PIC requests with the documents in swapped order: the second splices both."""
    from vllm_hysparse.pic.client import pic_text_extra_body

    system = "You answer questions from the documents below.\n"
    docs = ["Document: the Rhine flows north through Basel, Strasbourg and Cologne.\n" * 4,
            "Document: the Danube flows east through Vienna, Budapest and Belgrade.\n" * 4]
    for order in (docs, docs[::-1]):
        texts = [system, *order, "Question: which river flows through Vienna?\nAnswer:"]
        out = client.completions.create(model=model, prompt="", max_tokens=8, temperature=0,
                                        extra_body=pic_text_extra_body(texts, seam=8))
        print(f"[pic] {len(texts) - 2} documents, seam 8 -> {out.choices[0].text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--wait", type=float, default=300, help="seconds to wait for the server to come up")
    parser.add_argument("--questions", nargs="*", default=[], help="chat questions, each answered greedily")
    parser.add_argument("--random-weights", action="store_true", help="the served model has random weights")
    parser.add_argument("--long-words", type=int, default=800,
                        help="words in the long-context request (0: none); keep it within --max-model-len")
    args = parser.parse_args(argv)
    try:
        wait_until_healthy(args.base_url, args.wait)
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    for question in args.questions:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                               max_tokens=48, temperature=0)
        print(f"[question] {question}\n[answer]   {reply.choices[0].message.content.strip()}")
    prompt = "def fibonacci(n):\n    "
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    print(f"[completion] {prompt!r} -> {completion.choices[0].text!r}")
    print("[chat, streamed] ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        max_tokens=24, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    pic_demo(client, model)
    if args.long_words:
        long_context_demo(client, model, args.base_url, args.long_words)
    lines = hysparse_metrics(args.base_url)
    for line in lines:
        print(f"[metrics] {line}")
    summary = pages_per_query(lines)
    if summary:
        print(f"[pages per query] {summary}")
    if args.random_weights:
        print("(random demo weights: the text is not meant to make sense)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
