// Command godriver runs one scenario with the real Go RocketMQ client
// (github.com/apache/rocketmq-client-go/v2 v2.1.2) and prints ONE JSON object on stdout;
// the client's own logs go to stderr. Driven by rmqfast/testing/goclient.py.
//
//	produce      -ns A -topic T -count N -mode sync|batch|ordered [-prefix P] [-keys K]
//	consume-push -ns A -topic T -group G -expect N [-orderly] [-timeout-ms MS]
//	             [-instance NAME] [-sub "TagA || TagB"] [-stop-file PATH (ends once it exists)]
//	             [-trace-deliveries] [-fail-every K]
//	             (prints "CONSUMER_STARTED" on stderr once started)
//	consume-pull -ns A -topic T -group G -expect N [-timeout-ms MS]
//	retry-dlq    -ns A -topic T -group G -expect N -max-reconsume R [-orderly] [-timeout-ms MS]
//	             ([-linger-ms MS] stay up with connections open after the last message)
//
// Exit codes: 0 ok, 1 error, 2 send failures, 3 consumer incomplete/timed out, 64 usage.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/apache/rocketmq-client-go/v2"
	"github.com/apache/rocketmq-client-go/v2/consumer"
	"github.com/apache/rocketmq-client-go/v2/primitive"
	"github.com/apache/rocketmq-client-go/v2/producer"
	"github.com/apache/rocketmq-client-go/v2/rlog"
)

type received struct {
	Body        string `json:"body"`
	Topic       string `json:"topic"`
	QueueID     int    `json:"queue_id"`
	QueueOffset int64  `json:"queue_offset"`
	MsgID       string `json:"msg_id"`
	OffsetMsgID string `json:"offset_msg_id"`
	StoreHost   string `json:"store_host"`
	Uniq        string `json:"uniq_key"`
	Keys        string `json:"keys"`
	Reconsume   int32  `json:"reconsume_times"`
}

type result struct {
	Scenario     string           `json:"scenario"`
	OK           bool             `json:"ok"`
	Error        string           `json:"error,omitempty"`
	Sent         int              `json:"sent"`
	Failed       int              `json:"failed"`
	MsgIDs       []string         `json:"msg_ids,omitempty"`
	OffsetMsgIDs []string         `json:"offset_msg_ids,omitempty"`
	Queues       []int            `json:"queues,omitempty"`
	Received     []received       `json:"received,omitempty"`
	Attempts     map[string]int   `json:"attempts,omitempty"`
	DLQ          []received       `json:"dlq,omitempty"`
	Unique       int              `json:"unique"`
	ElapsedMs    int64            `json:"elapsed_ms"`
	Extra        map[string]int64 `json:"extra,omitempty"`
}

var (
	ns           = flag.String("ns", "", "name server host:port")
	topic        = flag.String("topic", "", "topic")
	group        = flag.String("group", "", "consumer or producer group")
	count        = flag.Int("count", 10, "messages to send")
	mode         = flag.String("mode", "sync", "sync|batch|ordered")
	prefix       = flag.String("prefix", "go", "body prefix")
	expect       = flag.Int("expect", 0, "messages to receive")
	orderly      = flag.Bool("orderly", false, "orderly push consumer")
	timeoutMs    = flag.Int("timeout-ms", 60000, "consumer deadline")
	maxReconsume = flag.Int("max-reconsume", 1, "max reconsume times (retry-dlq)")
	shardKeys    = flag.Int("shard-keys", 4, "sharding keys for ordered sends")
	instance     = flag.String("instance", "", "instance name of the consumer (client id ip@instance)")
	subExpr      = flag.String("sub", "", "tag expression of the consumer (\"\" = every tag)")
	stopFile     = flag.String("stop-file", "", "consume-push ends once this file exists")
	lingerMs     = flag.Int("linger-ms", 0, "stay up this long after the last message, "+
		"connections open, like a long-running application (lets connection observers see them)")
	failEvery = flag.Int("fail-every", 0, "consume-push: the first delivery of idx % K == 0 (user property idx) "+
		"is answered ConsumeRetryLater")
	trace = flag.Bool("trace-deliveries", false, "a \"DELIVERED run:idx broker:queue epoch_ms reconsume[ refused]\" "+
		"line on stderr per delivery (user properties run and idx, as the Java driver sends them)")
)

func emit(r *result, code int) {
	out, _ := json.Marshal(r)
	fmt.Println(string(out))
	os.Exit(code)
}

func ext(m *primitive.MessageExt) received {
	return received{
		Body: string(m.Body), Topic: m.Topic, QueueID: m.Queue.QueueId, QueueOffset: m.QueueOffset,
		MsgID: m.MsgId, OffsetMsgID: m.OffsetMsgId, StoreHost: m.StoreHost,
		Uniq: m.GetProperty(primitive.PropertyUniqueClientMessageIdKeyIndex), Keys: m.GetKeys(),
		Reconsume: m.ReconsumeTimes,
	}
}

func main() {
	flag.CommandLine.SetOutput(os.Stderr)
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: godriver SCENARIO [flags]")
		os.Exit(64)
	}
	scenario := os.Args[1]
	if err := flag.CommandLine.Parse(os.Args[2:]); err != nil {
		os.Exit(64)
	}
	rlog.SetLogLevel("warn")
	r := &result{Scenario: scenario, Attempts: map[string]int{}}
	start := time.Now()
	defer func() { r.ElapsedMs = time.Since(start).Milliseconds() }()
	if *ns == "" || *topic == "" {
		r.Error = "-ns and -topic are required"
		emit(r, 64)
	}
	switch scenario {
	case "produce":
		produce(r)
	case "consume-push":
		consumePush(r, false)
	case "retry-dlq":
		consumePush(r, true)
	case "consume-pull":
		consumePull(r)
	default:
		r.Error = "unknown scenario " + scenario + " (produce, consume-push, consume-pull, retry-dlq)"
		emit(r, 64)
	}
}

func produce(r *result) {
	opts := []producer.Option{
		producer.WithNameServer([]string{*ns}),
		producer.WithRetry(2),
		producer.WithGroupName(orDefault(*group, "go-producer")),
		producer.WithSendMsgTimeout(10 * time.Second),
	}
	if *mode == "ordered" {
		opts = append(opts, producer.WithQueueSelector(producer.NewHashQueueSelector()))
	}
	p, err := rocketmq.NewProducer(opts...)
	if err != nil {
		r.Error = err.Error()
		emit(r, 1)
	}
	if err = p.Start(); err != nil {
		r.Error = err.Error()
		emit(r, 1)
	}
	defer func() { _ = p.Shutdown() }()
	ctx := context.Background()
	record := func(res *primitive.SendResult, err error, n int) {
		if err != nil || res.Status != primitive.SendOK {
			r.Failed += n
			if err != nil {
				r.Error = err.Error()
			}
			return
		}
		r.Sent += n
		r.MsgIDs = append(r.MsgIDs, res.MsgID)
		r.OffsetMsgIDs = append(r.OffsetMsgIDs, res.OffsetMsgID)
		r.Queues = append(r.Queues, res.MessageQueue.QueueId)
	}
	switch *mode {
	case "sync", "ordered":
		for i := 0; i < *count; i++ {
			m := primitive.NewMessage(*topic, []byte(fmt.Sprintf("%s-%d", *prefix, i)))
			m.WithKeys([]string{fmt.Sprintf("key-%d", i)})
			if *mode == "ordered" {
				m.WithShardingKey("shard-" + strconv.Itoa(i%*shardKeys))
			}
			res, err := p.SendSync(ctx, m)
			record(res, err, 1)
		}
	case "batch":
		const size = 8
		for i := 0; i < *count; i += size {
			var ms []*primitive.Message
			for j := i; j < i+size && j < *count; j++ {
				m := primitive.NewMessage(*topic, []byte(fmt.Sprintf("%s-%d", *prefix, j)))
				m.WithKeys([]string{fmt.Sprintf("key-%d", j)})
				ms = append(ms, m)
			}
			res, err := p.SendSync(ctx, ms...)
			record(res, err, len(ms))
		}
	default:
		r.Error = "unknown -mode " + *mode + " (sync, batch, ordered)"
		emit(r, 64)
	}
	// connections stay open a moment, like a long-running application's (observers see them)
	time.Sleep(time.Duration(*lingerMs) * time.Millisecond)
	r.OK = r.Failed == 0 && r.Sent == *count
	r.Unique = r.Sent
	r.ElapsedMs = 0
	if !r.OK {
		emit(r, 2)
	}
	emit(r, 0)
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

type collector struct {
	mu   sync.Mutex
	seen map[string]bool
	msgs []received
	done chan struct{}
	want int
}

func newCollector(want int) *collector {
	return &collector{seen: map[string]bool{}, done: make(chan struct{}), want: want}
}

// traceDelivery prints the -trace-deliveries line of a delivery (suffix " refused": not acknowledged).
func traceDelivery(m *primitive.MessageExt, suffix string) {
	if *trace {
		fmt.Fprintf(os.Stderr, "DELIVERED %s:%s %s:%d %d %d%s\n", m.GetProperty("run"), m.GetProperty("idx"),
			m.Queue.BrokerName, m.Queue.QueueId, time.Now().UnixMilli(), m.ReconsumeTimes, suffix)
	}
}

// refuse tells whether -fail-every selects this delivery: the first one (not a retry) of idx % K == 0.
func refuse(m *primitive.MessageExt) bool {
	if *failEvery <= 0 || m.ReconsumeTimes > 0 {
		return false
	}
	idx, err := strconv.Atoi(m.GetProperty("idx"))
	return err == nil && idx%*failEvery == 0
}

func (c *collector) add(m *primitive.MessageExt) {
	c.mu.Lock()
	defer c.mu.Unlock()
	traceDelivery(m, "")
	c.msgs = append(c.msgs, ext(m))
	if !c.seen[string(m.Body)] {
		c.seen[string(m.Body)] = true
		if len(c.seen) == c.want {
			close(c.done)
		}
	}
}

func consumePush(r *result, retry bool) {
	grp := orDefault(*group, "go-consumer")
	opts := []consumer.Option{
		consumer.WithNameServer([]string{*ns}),
		consumer.WithGroupName(grp),
		consumer.WithConsumeFromWhere(consumer.ConsumeFromFirstOffset),
		consumer.WithConsumerModel(consumer.Clustering),
	}
	if *orderly {
		opts = append(opts, consumer.WithConsumerOrder(true),
			consumer.WithSuspendCurrentQueueTimeMillis(100*time.Millisecond))
	}
	if retry {
		opts = append(opts, consumer.WithMaxReconsumeTimes(int32(*maxReconsume)))
	}
	if *instance != "" {
		opts = append(opts, consumer.WithInstance(*instance))
	}
	c, err := rocketmq.NewPushConsumer(opts...)
	if err != nil {
		r.Error = err.Error()
		emit(r, 1)
	}
	col := newCollector(*expect)
	var amu sync.Mutex
	selector := consumer.MessageSelector{}
	if *subExpr != "" {
		selector = consumer.MessageSelector{Type: consumer.TAG, Expression: *subExpr}
	}
	err = c.Subscribe(*topic, selector, func(ctx context.Context, msgs ...*primitive.MessageExt) (consumer.ConsumeResult, error) {
		if !retry {
			for _, m := range msgs {
				if refuse(m) {
					traceDelivery(m, " refused")
					return consumer.ConsumeRetryLater, nil
				}
				col.add(m)
			}
			return consumer.ConsumeSuccess, nil
		}
		amu.Lock()
		for _, m := range msgs {
			r.Attempts[string(m.Body)]++
			r.Received = append(r.Received, ext(m))
		}
		amu.Unlock()
		if *orderly {
			return consumer.SuspendCurrentQueueAMoment, nil
		}
		if cc, ok := primitive.GetConcurrentlyCtx(ctx); ok {
			cc.DelayLevelWhenNextConsume = 1 // 1 s, not the broker's 10 s+ schedule
		}
		return consumer.ConsumeRetryLater, nil
	})
	if err != nil {
		r.Error = err.Error()
		emit(r, 1)
	}
	if err = c.Start(); err != nil {
		r.Error = err.Error()
		emit(r, 1)
	}
	fmt.Fprintln(os.Stderr, "CONSUMER_STARTED")
	deadline := time.After(time.Duration(*timeoutMs) * time.Millisecond)
	stopped := make(chan struct{})
	if *stopFile != "" {
		go func() {
			for {
				if _, e := os.Stat(*stopFile); e == nil {
					close(stopped)
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		}()
	}
	var dlq *collector
	if retry {
		// The dead-letter queue of the group, read by another group.  Its topic exists only once
		// the first message reached it, and a consumer whose Start found no route is finished:
		// start a fresh one (own instance name) until one starts.
		dlq = newCollector(*expect)
		go func() {
			for attempt := 0; ; attempt++ {
				d, e := rocketmq.NewPushConsumer(
					consumer.WithNameServer([]string{*ns}), consumer.WithGroupName(grp+"-dlq-reader"),
					consumer.WithInstance(fmt.Sprintf("dlq-%d", attempt)),
					consumer.WithConsumeFromWhere(consumer.ConsumeFromFirstOffset))
				if e == nil {
					e = d.Subscribe("%DLQ%"+grp, consumer.MessageSelector{}, func(ctx context.Context, msgs ...*primitive.MessageExt) (consumer.ConsumeResult, error) {
						for _, m := range msgs {
							dlq.add(m)
						}
						return consumer.ConsumeSuccess, nil
					})
				}
				if e == nil {
					if e = d.Start(); e == nil {
						return // the process exits when the scenario ends
					}
					_ = d.Shutdown()
				}
				select {
				case <-dlq.done:
					return
				case <-time.After(500 * time.Millisecond):
				}
			}
		}()
		col = dlq
	}
	select {
	case <-col.done:
		r.OK = true
	case <-stopped:
		r.OK = true
	case <-deadline:
		r.Error = "timed out"
	}
	time.Sleep(time.Duration(*lingerMs) * time.Millisecond)
	_ = c.Shutdown()
	col.mu.Lock()
	if retry {
		r.DLQ = col.msgs
	} else {
		r.Received = col.msgs
	}
	r.Unique = len(col.seen)
	col.mu.Unlock()
	if !r.OK {
		emit(r, 3)
	}
	emit(r, 0)
}

func consumePull(r *result) {
	c, err := rocketmq.NewPullConsumer(
		consumer.WithNameServer([]string{*ns}),
		consumer.WithGroupName(orDefault(*group, "go-pull")),
		consumer.WithConsumeFromWhere(consumer.ConsumeFromFirstOffset),
	)
	if err != nil {
		r.Error = err.Error()
		emit(r, 1)
	}
	if err = c.Subscribe(*topic, consumer.MessageSelector{}); err != nil {
		r.Error = err.Error()
		emit(r, 1)
	}
	if err = c.Start(); err != nil {
		r.Error = err.Error()
		emit(r, 1)
	}
	defer func() { _ = c.Shutdown() }()
	col := newCollector(*expect)
	deadline := time.Now().Add(time.Duration(*timeoutMs) * time.Millisecond)
	pulls := int64(0)
	for len(col.seen) < *expect && time.Now().Before(deadline) {
		res, err := c.Pull(context.Background(), 32)
		pulls++
		if err != nil {
			if !consumer.IsNoNewMsgError(err) {
				r.Error = err.Error()
			}
			time.Sleep(100 * time.Millisecond) // an empty queue: the pull API does not long-poll
			continue
		}
		if res.Status == primitive.PullFound {
			for _, m := range res.GetMessageExts() {
				col.add(m)
			}
		}
	}
	r.Received = col.msgs
	r.Unique = len(col.seen)
	r.Extra = map[string]int64{"pulls": pulls}
	sort.Slice(r.Received, func(i, j int) bool { return r.Received[i].Body < r.Received[j].Body })
	r.OK = r.Unique >= *expect
	if !r.OK {
		if r.Error == "" {
			r.Error = "timed out"
		}
		emit(r, 3)
	}
	r.Error = ""
	emit(r, 0)
}
