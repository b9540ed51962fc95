"""Running a base model's layers from outside its forward: a layer's own call and K/V-only passes (`calls`),
which linear outputs reach the cache (`kvprobe`), layer arguments once per window of positions (`args`),
skipped layers' K/V in batch (`kvfill`), the CPU multi-row layout (`fewrows`), exited rows leaving a batch
(`rowsplit`) and deferred K/V of skipped layers (`recompute`)."""
