"""Starting and stopping a real tritonserver on the model repository (``launcher``)."""
