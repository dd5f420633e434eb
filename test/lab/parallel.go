package lab

import "sync"

// InParallel calls f(0) ... f(n-1), at most `at` at a time, and returns
// when every call has. The lab's tests use it where each call mostly waits
// (a connection, an API round trip, processes in the VM).
func InParallel(at, n int, f func(i int)) {
	slots := make(chan struct{}, max(at, 1))
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		slots <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			f(i)
		}()
	}
	wg.Wait()
}
