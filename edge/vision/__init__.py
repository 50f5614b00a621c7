"""Images as compact features: decoding under caps, the ONNX encoder (labels and an int8 embedding),
OCR for documents, and the pipeline that replaces an app's image parts with `image_features` parts.
The gateway runs the same pipeline for images that reach it raw."""
