"""Login-node side: config validation, run directories, job launch. Never imports torch."""
