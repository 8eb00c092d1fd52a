// TLS smoke test of the Go client through rmqfast (tests/integration/test_it_14_tls.py).
//
// rocketmq-client-go v2.1.2, the release the main driver uses, has no TLS option; WithTls
// (TLS without certificate checks, InsecureSkipVerify) exists only in later, unreleased
// commits, pinned here by pseudo-version.  Sends -count messages with SendSync, then a push
// consumer reads them back; prints one JSON line: sent, received, tls.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/apache/rocketmq-client-go/v2"
	"github.com/apache/rocketmq-client-go/v2/consumer"
	"github.com/apache/rocketmq-client-go/v2/primitive"
	"github.com/apache/rocketmq-client-go/v2/producer"
	"github.com/apache/rocketmq-client-go/v2/rlog"
)

func main() {
	ns := flag.String("ns", "", "")
	topic := flag.String("topic", "", "")
	count := flag.Int("count", 10, "")
	useTls := flag.Bool("tls", true, "")
	flag.Parse()
	rlog.SetLogLevel("error")
	res := map[string]interface{}{"tls": *useTls}
	p, err := rocketmq.NewProducer(producer.WithNsResolver(primitive.NewPassthroughResolver([]string{*ns})),
		producer.WithGroupName("GoTlsPG"), producer.WithRetry(2), producer.WithTls(*useTls),
		producer.WithSendMsgTimeout(20*time.Second))
	if err != nil {
		panic(err)
	}
	if err = p.Start(); err != nil {
		panic(err)
	}
	sent := 0
	for i := 0; i < *count; i++ {
		r, err := p.SendSync(context.Background(), primitive.NewMessage(*topic, []byte(fmt.Sprintf("go-tls-%d", i))))
		if err != nil {
			res["send_error"] = err.Error()
			break
		}
		if r.Status == primitive.SendOK {
			sent++
		}
	}
	res["sent"] = sent
	var mu sync.Mutex
	got := map[string]bool{}
	c, err := rocketmq.NewPushConsumer(consumer.WithNsResolver(primitive.NewPassthroughResolver([]string{*ns})),
		consumer.WithGroupName("GoTlsCG"), consumer.WithTls(*useTls),
		consumer.WithConsumeFromWhere(consumer.ConsumeFromFirstOffset))
	if err != nil {
		panic(err)
	}
	done := make(chan struct{})
	c.Subscribe(*topic, consumer.MessageSelector{}, func(ctx context.Context, msgs ...*primitive.MessageExt) (consumer.ConsumeResult, error) {
		mu.Lock()
		defer mu.Unlock()
		for _, m := range msgs {
			got[string(m.Body)] = true
		}
		if len(got) >= sent && sent > 0 {
			select {
			case <-done:
			default:
				close(done)
			}
		}
		return consumer.ConsumeSuccess, nil
	})
	if err = c.Start(); err != nil {
		panic(err)
	}
	select {
	case <-done:
	case <-time.After(90 * time.Second):
	}
	mu.Lock()
	res["received"] = len(got)
	mu.Unlock()
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
	c.Shutdown()
	p.Shutdown()
	os.Exit(0)
}
