package daemon

// QueueKey is an item of a controller's work queue: either a job that is not
// about one object (a resync, a recomputation) or one object to converge.
// Being a struct, an object key can never be mistaken for a job.
type QueueKey struct {
	// Job names the job; empty for an object.
	Job string
	// Object is the "namespace/name" of the object to converge.
	Object string
}

// Job is the queue item of the named job.
func Job(name string) QueueKey { return QueueKey{Job: name} }

// ObjectKey is the queue item of the object "namespace/name".
func ObjectKey(key string) QueueKey { return QueueKey{Object: key} }

// String names the item in logs: the job's name, or the object's key.
func (k QueueKey) String() string {
	if k.Job != "" {
		return k.Job
	}
	return k.Object
}
