"""faiss k-means against scikit-learn's on the same points: fit time and final inertia.

The points are the transformed (smoothed, Hadamard-rotated) key sub-vectors of one layer of a
collection, sub-sampled once with a fixed seed; both libraries train on exactly that sample, with
the same number of centroids and iterations, and inertia is computed the same way for both
(`kvcalib.vq.inertia`), on the training sample and on all of the layer's sub-vectors.

    python benchmarks/kmeans.py runs/acts/pydoc-16x512 [--layer 10] [--config d4b8] [--points 65536] [--iters 30]

Needs scikit-learn besides the project.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvcalib import vq
from kvcalib.collect import Activations
from kvcalib.methods.vecinfer import keys_to_codec, smoothing_factors
from results import publish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("activations")
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--config", default="d4b8")
    parser.add_argument("--points", type=int, default=65536)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    from sklearn import __version__ as sklearn_version
    from sklearn.cluster import KMeans

    config = vq.VQConfig.parse(args.config)
    k = Activations(args.activations).layer(args.layer)["k"]
    everything = keys_to_codec(k, smoothing_factors(k), True).reshape(-1, config.dim)
    sample = everything[torch.randperm(everything.shape[0], generator=torch.Generator().manual_seed(0))[: args.points]]

    fit = vq.kmeans(sample, config, args.iters, seed=0, max_points_per_centroid=args.points)  # no further sampling
    start = time.perf_counter()
    km = KMeans(n_clusters=config.centroids, n_init=1, max_iter=args.iters, tol=0.0, random_state=0,
                algorithm="lloyd").fit(sample.numpy())
    sk_seconds = time.perf_counter() - start
    sk_codebook = torch.from_numpy(km.cluster_centers_).float()

    import faiss

    rows = ["| library | init | fit seconds | inertia (training sample) | inertia (all sub-vectors) |",
            "|---|---|---:|---:|---:|"]
    for name, init, seconds, codebook in ((f"faiss {faiss.__version__}", "random", fit.seconds, fit.codebook),
                                          (f"scikit-learn {sklearn_version}", "k-means++", sk_seconds, sk_codebook)):
        rows.append(f"| {name} | {init} | {seconds:.2f} | {vq.inertia(sample, codebook):.1f} | "
                    f"{vq.inertia(everything, codebook):.1f} |")
    title = (f"k-means: layer {args.layer} keys (smoothed + Hadamard) of {args.activations}, {args.config}, "
             f"{sample.shape[0]} of {everything.shape[0]} sub-vectors, {args.iters} iterations, CPU")
    table = "\n".join(rows)
    publish(title, table, sys.argv, not args.no_record)


if __name__ == "__main__":
    main()
