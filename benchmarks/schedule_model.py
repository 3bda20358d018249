"""A model of how a wgrad launch's work units spread over the persistent clusters: static
(cluster c takes units c, c + G, c + 2G, ...) against dynamic (each unit to the cluster that
frees up first), in expert order or longest expert first. It predicts what
``Tiling(dynamic=True)`` can gain on a split before any GPU run (kernel README, section 10).

A unit costs its expert's k-tiles (rows / 64, rounded up) plus ``epilogue`` k-tiles' worth;
every unit of an expert costs the same. Prints each schedule's longest cluster over the
balanced time (total / G: 1.00 is perfect):

    python benchmarks/schedule_model.py --shape Z --units-per-expert 32,66 --clusters 66

``--varlen-m`` models the varlen-M GEMMs' clusters instead (kernel README, section 23): the
CTA tiles one n-tile column of a launch runs, with 128-row tiles in 1x2 clusters (the default:
one m-tile, two n-tiles) or in 2x1 clusters (256-row units, two m-tiles sharing B), against
the ideal rows / 128. A 2x1 unit whose expert has ≤ 128 rows left occupied both CTAs ("2x1
whole"); the kernels now split such a tail over two n-tiles instead ("2x1", as many tiles as
1x2).

    python benchmarks/schedule_model.py --varlen-m --shape J
"""

from __future__ import annotations

import argparse
import heapq

from mlp_case import SHAPES, split_counts

K_TILE = 64  # a 16-bit k-tile of the wgrads: 64 token rows


def unit_costs(sizes: list[int], per_expert: int, order: list[int], epilogue: float) -> list:
    """The launch's units in hand-out order: ``per_expert`` units of each expert of ``order``."""
    costs = []
    for e in order:
        costs += [-(-sizes[e] // K_TILE) + epilogue] * per_expert
    return costs


def static_span(costs: list[float], clusters: int) -> float:
    loads = [0.0] * clusters
    for i, c in enumerate(costs):
        loads[i % clusters] += c
    return max(loads)


def dynamic_span(costs: list[float], clusters: int) -> float:
    free = [(0.0, c) for c in range(clusters)]
    for c in costs:
        t, who = heapq.heappop(free)
        heapq.heappush(free, (t + c, who))
    return max(t for t, _ in free)


def spans(sizes: list[int], per_expert: int, clusters: int, epilogue: float = 2.0) -> dict:
    """{schedule: longest cluster / balanced time} for one launch."""
    index = list(range(len(sizes)))
    longest = sorted(index, key=lambda e: -sizes[e])
    in_order = unit_costs(sizes, per_expert, index, epilogue)
    balanced = sum(in_order) / clusters
    return {
        "static": static_span(in_order, clusters) / balanced,
        "dynamic, expert order": dynamic_span(in_order, clusters) / balanced,
        "dynamic, longest first": dynamic_span(
            unit_costs(sizes, per_expert, longest, epilogue), clusters) / balanced,
    }


def varlen_m_tiles(sizes: list[int], cluster_m: int, tile_m: int = 128,
                   split_tail: bool = False) -> int:
    """CTA tiles per n-tile of a varlen-M launch: each expert's rows in units of
    ``cluster_m`` m-tiles, every CTA of a unit running a tile whether it has rows or not;
    with ``split_tail`` an expert's last unit of at most one tile's rows runs one tile per
    n-tile (its CTAs on neighbouring n-tiles: the kernels' 2x1 scheduler)."""
    unit = tile_m * cluster_m
    tiles = 0
    for rows in sizes:
        units = -(-rows // unit)
        tail = rows - (units - 1) * unit if units else 0
        short = split_tail and 0 < tail <= tile_m
        tiles += cluster_m * units - (cluster_m - 1 if short else 0)
    return tiles


def varlen_m_report(sizes: list[int]) -> dict[str, float]:
    """{cluster: CTA tiles / the ideal rows / 128} for 1x2 and 2x1 clusters, 2x1 with whole
    units only ("2x1 whole", the kernels before split tails) and with split tails."""
    ideal = sum(sizes) / 128
    return {"1x2": varlen_m_tiles(sizes, 1) / ideal,
            "2x1 whole": varlen_m_tiles(sizes, 2) / ideal,
            "2x1": varlen_m_tiles(sizes, 2, split_tail=True) / ideal}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Z", choices=sorted(SHAPES))
    p.add_argument("--units-per-expert", default="32,66",
                   help="units per expert of each launch (Q/Z: FC2 wgrad 32, FC1 wgrad 66)")
    p.add_argument("--clusters", type=int, default=66, help="persistent clusters (2-CTA: 66)")
    p.add_argument("--seeds", type=int, default=1, help="Zipf splits to model (skewed shapes)")
    p.add_argument("--varlen-m", action="store_true",
                   help="the varlen-M GEMMs' CTA tiles in 1x2 against 2x1 clusters instead")
    args = p.parse_args()
    s = SHAPES[args.shape]
    if args.varlen_m:
        for seed in range(args.seeds):
            got = varlen_m_report(split_counts(s, seed))
            print(f"{args.shape} seed {seed} CTA tiles / ideal: "
                  + "  ".join(f"{k} {v:.3f}" for k, v in got.items()))
        return
    for seed in range(args.seeds):
        sizes = split_counts(s, seed)
        for per_expert in (int(u) for u in args.units_per_expert.split(",")):
            got = spans(sizes, per_expert, args.clusters)
            cols = "  ".join(f"{k} {v:.2f}" for k, v in got.items())
            print(f"{args.shape} seed {seed} {per_expert:3d} units/expert: {cols}")


if __name__ == "__main__":
    main()
