"""Running a base model's layers from outside its forward: runs of layers, eager or compiled (`spans`), a layer's
own call, K/V-only passes and calls turned into calls for a tree mask or some of a chunk's positions (`calls`),
which linear outputs reach the cache (`kvprobe`), layer arguments once per window of positions (`args`),
skipped layers' K/V in batch (`kvfill`), the CPU multi-row layout (`fewrows`), exited rows leaving a batch
(`rowsplit`) and deferred K/V of skipped layers (`recompute`)."""
