"""Chain replication of a shard (van Renesse and Schneider, OSDI 2004): the
primary's journal of changes, the primary's service and the backup that follows it."""
