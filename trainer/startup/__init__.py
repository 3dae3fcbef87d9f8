"""A launch's start-up, one module per phase, run in this order by ``trainer.main.run``: ``boot`` (config, code
snapshot, MPI environment, logging, the stop flag, process groups, the tracker), ``parts`` (through ``recipe`` and
``model``: the recipe built and checked, the model placed and settled; then the loader, optimizer, monitors and
checkpointer), ``restore`` (the newest valid checkpoint and the sample order), ``allreduce`` (auto's plan and the
overlap check), the preflight (``trainer.observe.preflight``), ``begin`` (the start or resume event, the record)."""
