import os, sys, time, statistics, multiprocessing as mp
sys.path.insert(0, "/work/main/benchmarks")
import paired_steps as ps
def main():
    ctx, nreq, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    args = dict(kv_space_gib=4, rounds=rounds, chunk=2048, num_reqs=nreq, block_size=128, seed=0)
    spawn = mp.get_context("spawn")
    arms = {"dense": ("llama-small", {}), "fused": ("hysparse-small", {}), "dense2": ("llama-small", {}), "unfused": ("hysparse-small", {"X_NOFUSE": "1"})}
    w = {}
    for name, (ck, env) in arms.items():
        [os.environ.pop(x, None) for x in ("X_NOFUSE", "X_OURWIN", "THP_MEM_ALLOC_ENABLE")]; os.environ.update(env)
        a, b = spawn.Pipe()
        p = spawn.Process(target=ps.engine_worker, args=(b, f"/work/main/benchmarks/checkpoints/{ck}", ctx, args), daemon=True)
        p.start(); w[name] = (p, a)
    os.environ.pop("X_NOFUSE", None)
    for n, (p, c) in w.items(): assert c.recv() == "ready"
    names = list(arms); t = {n: [] for n in names}
    for r in range(rounds):
        for k in range(len(names)):
            n = names[(r + k) % len(names)]; time.sleep(0.02); w[n][1].send("decode"); t[n].append(w[n][1].recv())
    pf = {n: [] for n in names}
    for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 0):
        for k in range(len(names)):
            n = names[(r + k) % len(names)]; time.sleep(0.02); w[n][1].send("prefill"); pf[n].append(w[n][1].recv())
    for n, (p, c) in w.items(): c.send("stop")
    for n in names: print(n, "decode median", round(statistics.median(t[n]), 2), "prefill", round(statistics.median(pf[n]), 1) if pf[n] else None)
    for n in ("fused", "unfused", "dense2"):
        r = [a / b for a, b in zip(t[n], t["dense"])]
        print(n, "/ dense ratio median", round(statistics.median(r), 3), "mean", round(statistics.fmean(r), 3))
        if pf[n]: print(n, "prefill ratio", round(statistics.median([a / b for a, b in zip(pf[n], pf["dense"])]), 3))
    r = [a / b for a, b in zip(t["unfused"], t["dense2"])]
    print("thp hysparse/dense", round(statistics.median(r), 3))
    r = [a / b for a, b in zip(t["fused"], t["unfused"])]
    print("fused/unfused median", round(statistics.median(r), 3), "mean", round(statistics.fmean(r), 3))
if __name__ == "__main__": main()
