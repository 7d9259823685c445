//! Refit: moving the trainer's new weights to every generation rank after each step.
