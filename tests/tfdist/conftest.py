"""tf.distribute suites: each test starts workers through distmem's launcher (or one process) with a
hard timeout; TensorFlow runs only in those child processes."""
