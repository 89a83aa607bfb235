"""Where an offline batch's time goes, prefill and decode apart: torch.profiler's operator table for the
batch with 1 new token (prefill, and the one sampling step) and with the workload's new tokens (prefill
+ decode; decode = the difference). Not timed against anything: a profile, printed (not in results/log.md).

    python benchmarks/profile_cpu.py --model-config qwen2.5-0.5b --num-requests 16 --input-len 128 128 --output-len 64 64 --threads 2 [--cpu-linear mkl]
"""
import argparse
import sys
import time

import common


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    common.add_workload_args(p, num_requests=16, input_len=(128, 128), output_len=(64, 64))
    p.add_argument("--cpu-linear", default="onednn", choices=["onednn", "mkl"], help="EngineConfig.cpu_linear")
    p.add_argument("--rows", type=int, default=20, help="operators shown (default 20)")
    args = common.finish_args(p.parse_args(argv))
    from torch.profiler import ProfilerActivity, profile

    from pagoda.engine import LLM, SamplingParams
    path = common.model_path(args)
    workload, warmup = common.workloads(args, path)
    llm = LLM(path, dtype=args.dtype, device=args.device, cpu_linear=args.cpu_linear, enable_prefix_caching=False,
              quantization=common.quantization(args))
    prompts = [ids for ids, _ in workload]
    llm.generate([ids for ids, _ in warmup], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    seconds = {}
    for label, n in (("prefill (1 new token)", 1), (f"prefill + decode ({args.output_len[1]} new tokens)",
                                                    args.output_len[1])):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            seconds[label] = time.perf_counter() - t0
        print(f"## {label}: {seconds[label]:.2f} s ({llm.engine.config.dtype}, cpu_linear {args.cpu_linear})")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                        max_name_column_width=40))
    return 0


if __name__ == "__main__":
    sys.exit(main())
