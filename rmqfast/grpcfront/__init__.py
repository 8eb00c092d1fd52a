"""RocketMQ 5 gRPC front: ``apache.rocketmq.v2.MessagingService`` served over Remoting brokers."""
