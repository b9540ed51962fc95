"""Tide's early-exit decoding for this router repo, written by Tide (`pip install tide-transformers`).

    model.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True)

loads this repo's routers onto `model` (the base model they were calibrated on) once, keeps them on the model for
later calls, and decodes with Tide's loop. `tide_config={...}` sets a call's options, as for
`tide.TideForCausalLM.generate`; everything else is ordinary `generate`.
"""

import tide


def generate(model, **kwargs):
    return tide.TideForCausalLM.generate_with_router_repo(model, **kwargs)
