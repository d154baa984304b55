"""A replica's metrics as plain data, from its Prometheus registry to the fleet's /metrics text.

    Families = {family name: (type, help, {sample name: {labels: value}})}
    labels   = ((label, value), ...) sorted by label, as the Prometheus text writes them

    replica: families_of(registry) --report--> KVIndexActor.metrics[replica] --stats()--> ingress:
    merged_text({replica: families}) renders every replica's samples once, each labelled replica="ID";
    fleet_load({replica: families}) is the fleet's ORCA load report (fleet_metrics.py)

Families are named and split as `generate_latest` writes them (a counter's `_total` samples under its
name without `_total`, a `_created` sample in a gauge family of its own), so the merged text is the one
the replicas' own texts would give. Ray-free and torch-free.
"""

from __future__ import annotations

Labels = tuple[tuple[str, str], ...]
Family = tuple[str, str, dict[str, dict[Labels, float]]]  # (type, help, {sample name: {labels: value}})
Families = dict[str, Family]

_SPLIT = ("_created", "_gsum", "_gcount")  # samples generate_latest writes as gauge families of their own


def families_of(registry) -> Families:
    """A Prometheus registry's metrics (anything with `collect()`), as plain families."""
    out: Families = {}
    for metric in registry.collect():
        main: dict[str, dict[Labels, float]] = {}
        split: dict[str, dict[Labels, float]] = {}
        for s in metric.samples:
            suffix = next((x for x in _SPLIT if s.name == metric.name + x), None)
            into = main if suffix is None else split
            into.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
        out[metric.name] = (metric.type, metric.documentation, main)
        for name in sorted(split):
            out[name] = ("gauge", metric.documentation, {name: split[name]})
    return out


def value(families: Families, sample: str, **labels: str) -> float | None:
    """The value of the first sample named `sample` whose labels include `labels` (others, such as
    model_name, are not compared); None when there is none."""
    want = labels.items()
    for _, _, samples in families.values():
        for have, v in samples.get(sample, {}).items():
            if want <= dict(have).items():
                return v
    return None


def merged_text(per_replica: dict[str, Families]) -> str:
    """Several replicas' families as one Prometheus text, each sample labelled with its replica
    (families in the order first seen, replicas sorted)."""
    names: dict[str, tuple[str, str]] = {}
    for families in (per_replica[r] for r in sorted(per_replica)):
        for name, (kind, doc, _) in families.items():
            names.setdefault(name, (kind, doc))
    out = []
    for name, (kind, doc) in names.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for replica in sorted(per_replica):
            family = per_replica[replica].get(name)
            for sname, by_labels in family[2].items() if family is not None else ():
                for labels, v in by_labels.items():
                    body = ",".join(f'{k}="{_escape(x)}"' for k, x in (*labels, ("replica", replica)))
                    out.append(f"{sname}{{{body}}} {v}")
    return "\n".join(out)


def fleet_load(per_replica: dict[str, Families]) -> dict | None:
    """Mean kv_cache_usage_perc and summed num_requests_waiting over the replicas' metric families."""
    usage, waiting = "kvpage:kv_cache_usage_perc", "kvpage:num_requests_waiting"
    found = [(value(f, usage), value(f, waiting)) for f in per_replica.values()]
    found = [(u, w) for u, w in found if u is not None]
    if not found:
        return None
    return {usage.split(":")[1]: sum(u for u, _ in found) / len(found),
            waiting.split(":")[1]: int(sum(w or 0 for _, w in found))}  # fmt: skip


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
