"""What is decided before a run starts: per-rank memory plans of every recipe (:mod:`.memory`),
``+recipe=auto``'s choice among them (:mod:`.auto`), the dry run of an N-rank layout on a fake
process group (:mod:`.dry_run`), the machine checks of packages, files and servers
(:mod:`.preflight`), FLOPs per token for MFU (:mod:`.flops`), and a cluster sweep's jobs checked
before they are submitted (:mod:`.launcher`).

Sits above the parts it sizes: may import evaluation (its task checks), engines (their buffer
sizes), objectives, models, parallel, config and common; only the trainer and the commands
import it."""
