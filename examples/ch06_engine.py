"""Chapter 6: no scheduler, driving the Engine through prefill and decode by hand against HF generate.

    python examples/ch06_engine.py [smollm2-135m | tiny-qwen3 | tiny-qwen3-untied]
"""

import sys

import torch
from engine.core import Batch, Req, SamplingParams
from engine.distributed import DistributedInfo
from engine import Engine, EngineConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import zoo

path = str(zoo.path(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"))
engine = Engine(EngineConfig(model_path=path, tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                             max_running_req=4, num_page_override=1024, max_seq_len_override=256))
print(f"device {engine.device}, attention backend {engine.config.attention_backend}, KV pool {engine.num_pages} pages, "
      f"page table {tuple(engine.page_table.shape)}")

tok = AutoTokenizer.from_pretrained(path)
prompts = ["The capital of France is", "def fibonacci(n):"]
reqs = []
for row, p in enumerate(prompts):
    ids = tok(p).input_ids
    engine.page_table[row, :256] = torch.arange(row * 256, row * 256 + 256)  # "allocate" the KV locations by hand
    reqs.append(Req(input_ids=torch.tensor(ids, dtype=torch.int32), table_idx=row, cached_len=0,
                    output_len=8, uid=row, sampling_params=SamplingParams(max_tokens=8),
                    cache_handle=None))

outs = [[] for _ in reqs]
phase = "prefill"
for step in range(8):
    batch = Batch(reqs=reqs, phase=phase)
    engine.graph_runner.pad_batch(batch)
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs]).int()
    batch.input_ids = torch.cat([r.input_ids[r.cached_len:r.device_len] for r in reqs])
    batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len:r.device_len] for r in reqs])
    engine.attn_backend.prepare_metadata(batch)
    out = engine.forward_batch(batch, engine.sampler.prepare(batch))  # forward and sample, advancing the Req state
    out.copy_done_event.synchronize()  # the copy to next_tokens_cpu is non_blocking on CUDA: wait before reading it
    for i, r in enumerate(reqs):
        r.append_host(out.next_tokens_cpu[i:i + 1])
        outs[i].append(int(out.next_tokens_cpu[i]))
    if step == 0:
        print("prefill input tokens:", len(batch.input_ids), " then per decode step:", len(reqs))
    phase = "decode"

hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
for p, o in zip(prompts, outs):
    ids = tok(p, return_tensors="pt").input_ids
    ref = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    print(f"{p!r}: {tok.decode(o)!r}  matches HF: {o == ref}")
engine.shutdown()
