def hopfield_update(*args, **kwargs):
    raise NotImplementedError  # placeholder, being written


def hopfield_energy(*args, **kwargs):
    raise NotImplementedError  # placeholder, being written
