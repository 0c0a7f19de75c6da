"""TensorFlow models (``platform: "tensorflow_savedmodel"`` and ``"tensorflow_graphdef"``)."""
