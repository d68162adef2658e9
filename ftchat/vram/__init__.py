"""The VRAM plan (docs/design.md section 4.9): what a run allocates on its compute device, item by
item, from config.json and the safetensors headers (or a synthetic model's config) before any
tensor is loaded, and how many expert slots fit in what a budget leaves.

    items.py      what a plan is made of: Workload, Item, VramPlan (no ftchat imports)
    plan.py       the plan of a workload: the model family's items (ftchat/model/registry.py)
                  and the offload backend's, the estimates of transients
    search.py     the slots and the context that fit a budget, refusals, the prefill chunk
    workloads.py  settings -> workload (run, verify, bench), the plan's inputs, the CUDA cap
"""
