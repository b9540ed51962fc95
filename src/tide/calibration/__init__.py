"""`tide.calibrate` and what it is made of: data (`data`), held-out scoring (`evaluate`), threshold selection
(`thresholds`), measured costs and the cost model (`costs`), timing trials that decide what is kept (`trials`),
processes (`distributed`); `run` holds `calibrate` itself, a short list of named phases."""
