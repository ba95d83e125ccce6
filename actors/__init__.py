"""Ray actors of a job (Coordinator, TrainWorker): built in the Ray actor-groups issue."""
