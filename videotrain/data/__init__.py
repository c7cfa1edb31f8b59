"""Video data: synthetic generator, annotation readers, clip dataset, transforms, loaders."""
