"""prime: training language models on compute that comes and goes over slow links. Pretraining with
DiLoCo (pretrain/, diloco/) and asynchronous RL post-training with untrusted, verified inference workers
(rl/, inference/, verify/), on a shared core; `elastic_mesh` carries everything between processes."""
