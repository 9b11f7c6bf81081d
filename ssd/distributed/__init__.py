"""Process groups, rank roles and process placement for tensor parallelism (see ``launcher``)."""
