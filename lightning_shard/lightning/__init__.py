"""The Lightning face: ``ShardStrategy`` and its precision plugin, on top of the engine and checkpoint packages."""
