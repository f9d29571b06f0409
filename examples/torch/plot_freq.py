#!/usr/bin/env python3
"""plot_freq.py DIR - summarizes and plots the records examples/torch/freq_experiment.sh wrote
(DIR/<config>-seed<S>.json, configs t1, guided, fixed): DIR/summary.json, DIR/summary.md and,
when matplotlib is importable, DIR/freq-digits.png (test accuracy per epoch, mean over the seeds
with the min-max band; and T per step with the cumulative exchanges of one seed).
Every figure comes from the records: exchanges and pushes as tidewire_stats() counted them."""
import glob
import json
import os
import re
import statistics
import sys

NAMES = {"t1": "T = 1 (every step)", "guided": "quality-guided T (model averaging)", "fixed": "fixed T (model averaging)"}


def load(d):
    runs = {}
    for f in sorted(glob.glob(os.path.join(d, "*-seed*.json"))):
        m = re.match(r"(.+)-seed(\d+)\.json$", os.path.basename(f))
        if m:
            with open(f) as fh:
                runs.setdefault(m.group(1), {})[int(m.group(2))] = json.load(fh)
    return runs


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "bench/results/freq-digits"
    runs = load(d)
    if "t1" not in runs:
        sys.exit(f"no t1-seed*.json records in {d}")
    summary = {"configs": {}}
    for name, by_seed in runs.items():
        seeds = sorted(by_seed)
        acc = [by_seed[s]["final_test_accuracy"] for s in seeds]
        # Rank 0's own model at each epoch's end (between exchanges with T > 1: before averaging).
        per_epoch = [[e["test_accuracy"] for e in by_seed[s]["epochs"]] for s in seeds]
        ex = [by_seed[s]["stats"]["exchanges"] for s in seeds]
        steps = [by_seed[s]["stats"]["steps"] for s in seeds]
        pushes = [by_seed[s]["stats"]["pushes"] for s in seeds]
        r = by_seed[seeds[0]]
        summary["configs"][name] = {
            "label": NAMES.get(name, name),
            "comm_mode": r["comm_mode"], "comm_every": r["comm_every"], "quality_guided": r["quality_guided"],
            "comm_every_max": r["comm_every_max"] if r["quality_guided"] else None,
            "seeds": seeds, "final_test_accuracy": acc, "mean_final_test_accuracy": statistics.mean(acc),
            "mean_epoch_accuracy": [statistics.mean(pe[i] for pe in per_epoch) for i in range(min(map(len, per_epoch)))],
            "exchanges": ex, "mean_exchanges": statistics.mean(ex), "steps": steps, "session_pushes": pushes,
        }
    c = summary["configs"]
    base = c["t1"]
    for name, v in c.items():
        v["accuracy_minus_t1_points"] = 100 * (v["mean_final_test_accuracy"] - base["mean_final_test_accuracy"])
        v["exchange_reduction_vs_t1"] = base["mean_exchanges"] / v["mean_exchanges"]
    r0 = runs["t1"][min(runs["t1"])]
    summary["setup"] = {k: r0[k] for k in ("procs", "epochs_n", "lr", "momentum", "global_batch", "torch")}
    if "guided" in runs:
        g = runs["guided"][min(runs["guided"])]
        summary["setup"].update({k: g[k] for k in ("comm_every_max", "quality_period", "quality_tolerance",
                                                   "quality_revert_at")})
        summary["guided_decisions_first_seed"] = g.get("freq_history")
        summary["guided_memory_first_seed"] = g.get("freq_memory")
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    lines = ["| configuration | final test accuracy, % (mean over seeds; per seed) | vs T = 1 | "
             "rank 0's accuracy per epoch before the final flush, % (mean) | exchanges (mean) | fewer than T = 1 |",
             "|---|---|---|---|---|---|"]
    for name in [n for n in ("t1", "guided", "fixed") if n in c] + [n for n in c if n not in ("t1", "guided", "fixed")]:
        v = c[name]
        label = v["label"] + (f", T = {v['comm_every']}" if name == "fixed" else "")
        lines.append(f"| {label} | {100 * v['mean_final_test_accuracy']:.2f}% "
                     f"({', '.join(f'{100 * a:.2f}' for a in v['final_test_accuracy'])}) | "
                     f"{v['accuracy_minus_t1_points']:+.2f} points | "
                     f"{' '.join(f'{100 * a:.1f}' for a in v['mean_epoch_accuracy'])} | {v['mean_exchanges']:.1f} | "
                     f"{v['exchange_reduction_vs_t1']:.2f}x |")
    md = "\n".join(lines) + "\n"
    with open(os.path.join(d, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no PNG (set PLOT_PYTHON to an interpreter that has it)")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"t1": "tab:blue", "guided": "tab:green", "fixed": "tab:red"}
    for name in c:
        by_seed = runs[name]
        curves = [[e["test_accuracy"] for e in by_seed[s]["epochs"]] for s in sorted(by_seed)]
        n = min(len(x) for x in curves)
        xs = list(range(1, n + 1))
        mean = [statistics.mean(cv[i] for cv in curves) * 100 for i in range(n)]
        lo = [min(cv[i] for cv in curves) * 100 for i in range(n)]
        hi = [max(cv[i] for cv in curves) * 100 for i in range(n)]
        v = c[name]
        lab = f"{v['label']}{', T = ' + str(v['comm_every']) if name == 'fixed' else ''}: {v['mean_exchanges']:.0f} exchanges"
        ax1.plot(xs, mean, marker="o", color=colors.get(name), label=lab)
        ax1.fill_between(xs, lo, hi, color=colors.get(name), alpha=0.15)
        ax1.plot([n + 0.3], [100 * v["mean_final_test_accuracy"]], marker="*", markersize=12, color=colors.get(name))
    ax1.set_ylabel("test accuracy, %: rank 0's model (mean, min-max band)")
    ax1.set_xlabel("epoch (star: final, after flush() averaged the replicas)")
    ax1.set_title(f"digits MLP, {summary['setup']['procs']} processes, {len(runs['t1'])} seeds")
    ax1.legend(fontsize=8, loc="lower right")
    ax1.grid(alpha=0.3)
    for name in c:
        r = runs[name][min(runs[name])]
        ts = r.get("t_per_step") or [1] * r["stats"]["steps"]
        ax2.step(range(len(ts)), ts, where="post", color=colors.get(name), label=f"{NAMES.get(name, name)}: T per step")
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel(f"step (seed {min(runs['t1'])})")
    ax2.set_ylabel("T (steps per exchange)")
    ax2.set_title("communication frequency")
    ax2.legend(fontsize=8, loc="upper left")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(d, "freq-digits.png")
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
