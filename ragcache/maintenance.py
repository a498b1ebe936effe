"""Store-wide maintenance without a model: delete a document with its entries, verify, collect garbage.

Entry keys are rebuilt from what the store itself holds: every (model, tokenizer, dtype, layout, codec) found in
entry metadata, applied to every document's chunk records. The one delete keeps the entries another document
still uses; `ragcache store` calls all of this.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from ragcache.store import Store
from ragcache.store.base import TierUnavailable, batched
from ragcache.store.keys import HEADS, KEYED_BY, entry_form, entry_key, summary_codec

from .documents import checksum_only, chunks_problem, doc_name, record_problem, text_intact

WRITE_TIME_SLACK_S = 2.0  # file times come from a coarser clock than time.time(), and some filesystems keep seconds


def tiers_of(store: Store) -> list[Store]:
    return list(getattr(store, "tiers", [store]))


def silent(stage: str, done: int, total: int) -> None:
    pass


Progress = Callable[[str, int, int], None]  # (stage, items done, items in all), after each batch of a long stage


def headers(
    store: Store, progress: Progress = silent, stage: str = "reading entry headers", total: int | None = None
) -> Iterator[tuple[str, dict]]:
    """(key, summary) of each entry in the store, a batch of headers a round trip; an entry removed while the keys
    were listed is left out. `total`: the entries expected (the tier's count), so that the keys stream and a store of
    millions is never listed whole; without it the keys are listed first."""
    keys: Iterable[str] = store.keys()
    if total is None:
        keys = list(keys)
        total = len(keys)
    done = 0
    for batch in batched(keys):
        for key, info in zip(batch, store.describe_many(batch)):
            if info is not None:
                yield key, info
        done += len(batch)
        progress(stage, done, max(total, done))


def _delete_keys(store: Store, keys: list[str], stage: str, progress: Progress) -> int:
    """Entries deleted of `keys`, a batch at a time, `progress` hearing of each."""
    deleted = done = 0
    for batch in batched(keys):
        deleted += sum(store.delete(k) for k in batch)
        done += len(batch)
        progress(stage, done, len(keys))
    return deleted


def delete(store: Store, doc_id: str, progress: Progress = silent) -> dict | None:
    """Delete a document's records and the entries of its chunks, under every model, dtype and layout the store holds,
    except entries another document also uses. None if the document is unknown."""
    outages = store.outages()
    names = store.record_names(f"chunks/{doc_id}/")
    found = store.get_record(doc_name(doc_id)) is not None or names
    every_tier_answered(store, "deleting a document", outages)  # unknown only if no tier holds it
    if not found:
        return None
    combos = _compile_combos(store, progress)
    own = _entry_keys(store, names, combos)
    keys = sorted(own - referenced_keys(store, combos, but=doc_id, progress=progress, within=own))
    every_tier_answered(store, "deleting a document", outages)
    entries = _delete_keys(store, keys, "deleting entries", progress)
    records = sum(store.delete_record(n) for n in [*names, doc_name(doc_id)])
    return {"records": records, "entries": entries}


def every_tier_answered(store: Store, what: str, outages: int) -> None:
    """Deciding which entries nothing refers to needs every tier's records. A tiered store skips a tier that is down
    (a query goes on without it), and takes it back once it answers: the documents only that tier holds would look
    gone, and their entries be deleted. `outages`: the store's count (Store.outages) when the pass began; a tier
    that failed since, even one back by now, may have left names out of it."""
    down = [name for name, up in store.tier_states() if not up]
    if down or store.outages() != outages:
        raise TierUnavailable(
            f"{what} needs every tier's records, and {', '.join(down) or 'a tier that failed during the pass'} did "
            "not answer: nothing was deleted; run it again once every tier is up"
        )


def referenced_keys(
    store: Store,
    combos: set | None = None,
    but: str | None = None,
    progress: Progress = silent,
    within: set[str] | None = None,
) -> set[str]:
    """Every entry key some document (but `but`) maps its chunks to, under the (model, tokenizer, dtype, layout)s in
    the store; only those `within`, where given (the keys the caller asks about: the set stays that small)."""
    combos = _compile_combos(store, progress) if combos is None else combos
    names = [n for n in store.record_names("chunks/") if n.split("/")[1] != but]  # one listing for every document
    return _entry_keys(store, names, combos, progress, within)


def entries_of_forms(store: Store, forms: set[str], progress: Progress = silent) -> dict[str, list[str]]:
    """Keys of the entries compiled in each of `forms` (a compute dtype, plus "/codec" when stored in another
    one), from one pass over the store's summaries."""
    found: dict[str, list[str]] = {form: [] for form in forms}
    for key, info in headers(store, progress):
        if (form := entry_form(info)) in found:
            found[form].append(key)
    return found


def verify(store: Store, fix: bool = False, drop_checksum_only: bool = False, progress: Progress = silent) -> dict:
    """Decode every entry of every tier and read every record; with fix, delete what is bad, except records whose one
    fault is their checksum (see `documents.checksum_only`: a store key other than the writer's fails every record
    that way) and document records whose text still hashes to their id (`documents.text_intact`: a record written
    before checksums were kept, an edited budget), unless drop_checksum_only: a document's text cannot be rebuilt."""
    report: dict = {
        "checked": 0,
        "bad": [],
        "fixed": 0,
        "records_checked": 0,
        "bad_records": [],
        "kept": 0,
        "unverified": [],  # tiers that did not answer
    }
    for tier in tiers_of(store):
        try:
            _verify_tier(tier, fix, drop_checksum_only, progress, report)
        except TierUnavailable as exc:  # the other tiers are verified still; the caller hears of this one
            report["unverified"].append({"tier": tier.name, "problem": str(exc)})
    return report


def _verify_tier(tier: Store, fix: bool, drop_checksum_only: bool, progress: Progress, report: dict) -> None:
    keys, names = list(tier.keys()), tier.record_names()
    stage, done = f"verifying {tier.name}", 0
    for batch in batched(keys, 32):
        _verify_entries(tier, batch, fix, report)
        done += len(batch)
        progress(stage, done, len(keys) + len(names))
    for batch in batched(names, 32):
        _verify_records(tier, batch, fix, drop_checksum_only, report)
        done += len(batch)
        progress(stage, done, len(keys) + len(names))


def _verify_entries(tier: Store, keys: list[str], fix: bool, report: dict) -> None:
    for key, problem in zip(keys, tier.check_many(keys)):
        if problem is not None and problem != "missing":
            problem = tier.check_many([key])[0]  # once more: an entry written again while it was read is sound
        if problem == "missing":
            continue  # evicted or deleted while we looked
        report["checked"] += 1
        if problem is not None:
            report["bad"].append({"tier": tier.name, "key": key, "problem": problem})
            if fix:
                tier.delete(key)
                report["fixed"] += 1


def _verify_records(tier: Store, names: list[str], fix: bool, drop_checksum_only: bool, report: dict) -> None:
    for name, record in zip(names, tier.get_records(names)):  # a batch a round trip
        report["records_checked"] += 1
        problem = record_problem(name, record)
        if problem is not None:  # once more: a record written again while it was read (a re-upload) is sound
            record = tier.get_record(name)
            problem = record_problem(name, record) if record is not None else None
        if problem is None:
            continue
        only, intact = checksum_only(name, record), text_intact(name, record)
        report["bad_records"].append(
            {"tier": tier.name, "name": name, "problem": problem, "checksum_only": only, "text_intact": intact}
        )
        if fix and (only or intact) and not drop_checksum_only:
            report["kept"] += 1
        elif fix:
            # its chunk records first (they would keep its entries from every gc): a fix cut short between the two
            # leaves the damaged record, which the next verify finds again, not chunk records nothing names
            if name.startswith("doc/"):
                for chunks in tier.record_names(f"chunks/{name.split('/', 1)[1]}/"):
                    tier.delete_record(chunks)
            tier.delete_record(name)
            report["fixed"] += 1


def collect_garbage(
    store: Store,
    tmp_age_s: float = 600.0,
    unreferenced: bool = False,
    drop_forms: tuple[str, ...] = (),
    progress: Progress = silent,
) -> dict:
    report: dict = {}
    # before the tiers' own gc, so that their indexes see the space freed
    if drop_forms:  # a pass over every entry's header: only when forms are dropped
        for form, keys in entries_of_forms(store, set(drop_forms), progress).items():
            report[f"dropped {form}"] = _delete_keys(store, keys, f"dropping {form}", progress)
    for tier in tiers_of(store):
        if hasattr(tier, "gc"):
            report[tier.name] = tier.gc(tmp_age_s)
        elif hasattr(tier, "evict"):
            report[tier.name] = {"evicted": tier.evict()}
    if unreferenced:
        report["unreferenced_removed"] = _drop_unreferenced(store, progress)
    return report


def _drop_unreferenced(store: Store, progress: Progress) -> int:
    """Delete the entries no document refers to, sparing what a concurrent compile writes: the entries are listed
    before the records are read (a compile writes a document's records before its entries, so a listed entry of a
    document being compiled is referenced by then), and an entry written since the pass began (its `written` time,
    where the tier keeps one: disk and Redis) is spared even if nothing refers to it yet."""
    started, outages = time.time() - WRITE_TIME_SLACK_S, store.outages()
    every_tier_answered(store, "gc --unreferenced", outages)
    listed = list(store.keys())
    wanted = referenced_keys(store, progress=progress, within=set(listed))
    every_tier_answered(store, "gc --unreferenced", outages)
    removed = 0
    for batch in batched([key for key in listed if key not in wanted]):
        for key, info in zip(batch, store.describe_many(batch)):
            if info is not None and (info.get("written") or 0) < started:
                removed += store.delete(key)
    return removed


def lead_ids_of_layout(tag: str) -> list[int] | None:
    """Token ids a compile layout stores in front of a chunk, from the layout tag kept in entry metadata
    (`name:lead,ids:sink,ids`, as ragcache.compiler.Layout.tag writes it); None if the tag is not of that form."""
    parts = tag.split(":")
    if len(parts) != 3:
        return None
    try:
        return [int(x) for x in parts[1].split(",") if x]
    except ValueError:
        return None


def _compile_combos(store: Store, progress: Progress = silent) -> set[tuple[str, ...]]:
    """(model, tokenizer, dtype, layout, heads, codec) of the entries in the store: what chunk keys can be rebuilt from."""
    combos = set()
    for _, info in headers(store, progress):
        meta = info.get("meta") or {}
        if meta.get("model") and meta.get("tokenizer") and meta.get("layout"):
            keyed = (meta.get(name, "") for name in (*KEYED_BY, HEADS))
            combos.add((*keyed, summary_codec(info)))
    return combos


def _entry_keys(
    store: Store, names: list[str], combos: set, progress: Progress = silent, within: set[str] | None = None
) -> set[str]:
    """Keys of the chunks these chunk records hold, under every (model, tokenizer, dtype, layout, codec) present in
    the store (only those `within`, where given); the records are read in batches."""
    forms = []
    for *keyed, codec in combos:
        meta = {name: value for name, value in zip((*KEYED_BY, HEADS), keyed) if value or name != HEADS}
        if (lead := lead_ids_of_layout(meta["layout"])) is not None:
            forms.append((meta, codec, lead))
    keys: set[str] = set()
    done = 0
    for batch in batched(names):
        for name, record in zip(batch, store.get_records(batch)):
            record = (
                record if isinstance(record, dict) and chunks_problem(record.get("chunks"), 1 << 31) is None else {}
            )
            tokenizer_prefix = name.rsplit("/", 1)[-1].split("-", 1)[0]
            for meta, codec, lead in forms:
                if meta["tokenizer"].startswith(tokenizer_prefix):
                    made = (entry_key(meta, codec, [*lead, *ids]) for ids in record.get("chunks", []))
                    keys.update(made if within is None else (key for key in made if key in within))
        done += len(batch)
        progress("reading chunk records", done, len(names))
    return keys
