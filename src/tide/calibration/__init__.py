"""`tide.calibrate` and what it is made of. `run` holds `calibrate` itself, its phases called in order:
reading and splitting the texts (`texts`, from `data` and `selftext`), training the heads and routers (`trainer`,
on one base forward per batch: `forward`; the heads' loss: `headloss`), held-out scoring (`heldout`), cost
measurement and the operating point for the target (`operating`: selection by `thresholds`, checkpoints pruned by
the cost model in `costs`, the check through the decode step in `validation`), the timing trials that decide what
is kept (`timing`, running `trials`; timing a step's pieces: `measure`), and the record (`record`). `options`
holds `CalibrationOptions`, `phases` what the phases share, `distributed` the processes, `evaluate` teacher-forced
scoring through the decode step."""
