package lambdalake.realtime;

import com.datastax.oss.driver.api.core.ConsistencyLevel;
import com.datastax.oss.driver.api.core.CqlIdentifier;
import com.datastax.oss.driver.api.core.CqlSession;
import com.datastax.oss.driver.api.core.DefaultConsistencyLevel;
import com.datastax.oss.driver.api.core.cql.BatchStatement;
import com.datastax.oss.driver.api.core.cql.BatchStatementBuilder;
import com.datastax.oss.driver.api.core.cql.BatchType;
import com.datastax.oss.driver.api.core.cql.ColumnDefinitions;
import com.datastax.oss.driver.api.core.cql.PreparedStatement;
import com.datastax.oss.driver.api.core.servererrors.InvalidQueryException;
import com.datastax.oss.driver.api.core.servererrors.ServerError;
import com.datastax.oss.driver.api.core.servererrors.SyntaxError;
import com.datastax.oss.driver.api.core.servererrors.UnauthorizedException;
import com.datastax.oss.driver.api.core.type.DataType;
import com.datastax.oss.driver.api.core.type.DataTypes;
import java.math.BigDecimal;
import java.math.BigInteger;
import java.nio.ByteBuffer;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.apache.logging.log4j.LogManager;
import org.apache.logging.log4j.Logger;
import org.apache.spark.sql.ForeachWriter;
import org.apache.spark.sql.Row;

/**
 * Writes the {@code latest} views' ranked candidates to Cassandra: per candidate the same two
 * statements as the micro-batch path's writer (lambdalake/cassandra/writer.py), an INSERT of the
 * candidate and a DELETE of the key's lower-ranked ones, at the settings' consistency; a candidate
 * that a better one this task wrote beats is not written. An idle writer sends a candidate as it
 * arrives; candidates that wait for a request go out together, up to {@code groupRows} in one
 * unlogged batch, as the micro-batch writer groups its rows (a request costs the cluster about as
 * much as two of the rows it carries: docs/benchmarks-log.md, 2026-12-05). A batch the cluster
 * refuses as too large is sent again in halves.
 *
 * <p>A row is a record: its first column holds a writer schema id the query could not decode (null
 * otherwise), and each later column one view's candidate (a struct of the view table's columns in
 * its order), null where the view does not keep the record. A row with an unknown id stops the task
 * with {@link UnknownWriterSchema}, and the query is started again knowing it, from its checkpoint.
 *
 * <p>Delivery: at least once, idempotent. Writes go out as rows arrive (a bounded number of requests
 * in flight); {@link #close} waits for all of them, so the epoch's offsets are committed only after
 * its candidates are acknowledged. A write that fails for a reason a retry can mend (a timeout, a
 * replica down) is sent again with backoff for up to {@code giveUpAfterMs}, then fails the task.
 */
public final class CandidateWriter extends ForeachWriter<Row> {
  private static final long serialVersionUID = 1L;
  /**
   * Requests in flight per task while records arrive. One: an idle writer still sends a candidate as
   * it arrives, while under a backlog the candidates wait, the latest of a key replaces its waiting
   * one, and they go out {@code groupRows} a request. More requests in flight sent more rows and took
   * the cores the query reads with (docs/benchmarks-log.md, 2026-12-05).
   */
  private static final int STREAMING = 1;
  /** Requests in flight per task as a batch ends: what waits is sent before the offsets commit. */
  private static final int IN_FLIGHT = 16;
  /** How much of a failure's message a retry's log line quotes. */
  private static final int QUOTED = 240;
  /** Cassandra 5.0's words for a table its schema lacks. */
  private static final Pattern MISSING_TABLE = Pattern.compile("table \"?([\\w]+)\"? does not exist");

  private static final Logger LOG = LogManager.getLogger(CandidateWriter.class);

  private final Cluster cluster;
  private final String[] insertCqls;
  private final String[] deleteCqls;
  private final int[][] deleteAts;
  private final int[][] orderAts;
  private final String consistency;
  private final int groupRows;
  private final long giveUpAfterMs;

  private transient CqlSession session;
  private transient PreparedStatement[] inserts;
  private transient PreparedStatement[] deletes;
  private transient Semaphore slots;
  private transient ConcurrentLinkedQueue<Failed> failed;
  private transient ConsistencyLevel level;
  /**
   * Candidates waiting for a request slot, the best of each view's key (the latest rule), oldest
   * key first: a key that is written again waits its turn behind the others, so under a backlog a
   * hot key's candidates that can never win are not sent at all.
   */
  private transient LinkedHashMap<Slot, Candidate> waiting;
  /**
   * The best candidate of each view's key this task has written since it opened: a candidate it
   * beats is never written (Cassandra holds the better one, or will when close() returns). Another
   * task may write the key too (a view keyed otherwise than the topic); the read serves the best.
   */
  private transient Map<Slot, Candidate> written;
  private transient Object lock;
  private transient volatile int limit;

  /**
   * @param cluster where to connect (contact points, port, credentials, protocol version).
   * @param insertCqls per view, its table's INSERT, one marker a column, in the candidates' order.
   * @param deleteCqls per view, the DELETE of a key's lower candidates (the partition key, the rank).
   * @param deleteAts per view, where the DELETE's values are among a candidate's columns.
   * @param orderAts per view, where a candidate's rank, Kafka partition and offset are.
   * @param consistency a CQL consistency level's name (the settings' {@code consistency}).
   * @param groupRows the most candidates one request carries (the settings' {@code batch_rows}).
   * @param giveUpAfterMs how long a retryable failure is retried before the task fails.
   */
  public CandidateWriter(
      Cluster cluster,
      List<String> insertCqls,
      List<String> deleteCqls,
      List<List<Integer>> deleteAts,
      List<List<Integer>> orderAts,
      String consistency,
      int groupRows,
      long giveUpAfterMs) {
    this.cluster = cluster;
    this.insertCqls = insertCqls.toArray(new String[0]);
    this.deleteCqls = deleteCqls.toArray(new String[0]);
    this.deleteAts = new int[deleteAts.size()][];
    for (int v = 0; v < this.deleteAts.length; v++) {
      this.deleteAts[v] = deleteAts.get(v).stream().mapToInt(Integer::intValue).toArray();
    }
    this.orderAts = new int[orderAts.size()][];
    for (int v = 0; v < this.orderAts.length; v++) {
      this.orderAts[v] = orderAts.get(v).stream().mapToInt(Integer::intValue).toArray();
    }
    this.consistency = consistency;
    this.groupRows = Math.max(1, groupRows);
    this.giveUpAfterMs = giveUpAfterMs;
  }

  @Override
  public boolean open(long partitionId, long epochId) {
    ExpectedFailures.install();
    session = Sessions.get(cluster);
    inserts = new PreparedStatement[insertCqls.length];
    deletes = new PreparedStatement[deleteCqls.length];
    for (int v = 0; v < inserts.length; v++) {
      inserts[v] = Sessions.prepare(session, insertCqls[v]);
      deletes[v] = Sessions.prepare(session, deleteCqls[v]);
    }
    level = DefaultConsistencyLevel.valueOf(consistency);
    slots = new Semaphore(IN_FLIGHT);
    failed = new ConcurrentLinkedQueue<>();
    waiting = new LinkedHashMap<>();
    written = new HashMap<>();
    lock = new Object();
    limit = STREAMING;
    return true;
  }

  @Override
  public void process(Row row) {
    if (!row.isNullAt(0)) {
      throw new UnknownWriterSchema(row.getInt(0));
    }
    retryFailed();
    for (int v = 0; v < inserts.length; v++) {
      if (!row.isNullAt(1 + v)) {
        offer(v, row.getStruct(1 + v));
      }
    }
  }

  @Override
  public void close(Throwable error) {
    if (session == null || error != null) {
      return;
    }
    limit = IN_FLIGHT;
    while (true) {
      List<Candidate> group;
      synchronized (lock) {
        group = take();
      }
      if (group.isEmpty()) {
        break;
      }
      slots.acquireUninterruptibly();
      write(group);
    }
    slots.acquireUninterruptibly(IN_FLIGHT);
    slots.release(IN_FLIGHT);
    while (!failed.isEmpty()) {
      retryFailed();
    }
  }

  /** A candidate's columns as its table's INSERT binds them. */
  private Object[] values(int view, Row candidate) {
    ColumnDefinitions columns = inserts[view].getVariableDefinitions();
    Object[] values = new Object[columns.size()];
    for (int i = 0; i < values.length; i++) {
      values[i] = value(candidate, i, columns.get(i).getType());
    }
    return values;
  }

  /**
   * Writes a candidate now if a slot is free and none waits; otherwise keeps it, or the better of it
   * and the key's waiting one. A record that finds the writer idle is written as it arrives; under
   * a backlog the waiting candidates go out up to {@code groupRows} a request, a key's candidates
   * that can never win are not written at all, and Cassandra gets fewer requests. A
   * candidate beaten by one this task wrote is dropped: only winners are written. Only a written
   * candidate's columns are all converted; the others' key and rank only.
   */
  private void offer(int view, Row row) {
    ColumnDefinitions columns = inserts[view].getVariableDefinitions();
    int[] at = deleteAts[view];
    Object[] key = new Object[at.length - 1];
    for (int i = 0; i < key.length; i++) {
      key[i] = value(row, at[i], columns.get(at[i]).getType());
    }
    int[] order = orderAts[view];
    Candidate candidate =
        new Candidate(
            view, row, (BigDecimal) row.get(order[0]), row.getInt(order[1]), row.getLong(order[2]));
    Slot slot = new Slot(view, Arrays.asList(key));
    synchronized (lock) {
      Candidate best = written.get(slot);
      if (best != null && !candidate.beats(best)) {
        return;
      }
      Candidate held = waiting.get(slot);
      if (held != null) {
        if (candidate.beats(held)) {
          waiting.put(slot, candidate); // keeps the key's place in the queue
        }
      } else if (waiting.isEmpty() && free()) {
        written.put(slot, candidate);
        write(List.of(candidate));
        return;
      } else {
        waiting.put(slot, candidate);
      }
    }
    drain();
  }

  /** Takes a request slot if fewer than the phase's limit are in flight (under the lock). */
  private boolean free() {
    return IN_FLIGHT - slots.availablePermits() < limit && slots.tryAcquire();
  }

  /** Writes waiting candidates while slots are free. */
  private void drain() {
    synchronized (lock) {
      while (!waiting.isEmpty() && free()) {
        write(take());
      }
    }
  }

  /** Up to {@code groupRows} of the waiting candidates, oldest first, taken as written (under the lock). */
  private List<Candidate> take() {
    List<Candidate> group = new ArrayList<>(Math.min(groupRows, waiting.size()));
    var entries = waiting.entrySet().iterator();
    while (entries.hasNext() && group.size() < groupRows) {
      var entry = entries.next();
      entries.remove();
      written.put(entry.getKey(), entry.getValue());
      group.add(entry.getValue());
    }
    return group;
  }

  /** Sends candidates whose slot is taken already, in one request. */
  private void write(List<Candidate> group) {
    dispatch(group, System.currentTimeMillis() + giveUpAfterMs);
  }

  /** Sends a request whose slot is taken; a failure is kept for the task's thread to retry. */
  private void dispatch(List<Candidate> group, long deadline) {
    session
        .executeAsync(statement(group))
        .whenComplete(
            (result, error) -> {
              if (error != null) {
                // Kept before the slot is freed: close() waits for every slot, then for the kept.
                failed.add(new Failed(group, error, deadline));
                slots.release();
                return; // no drain: a write that fails at once would recurse here
              }
              slots.release();
              drain();
            });
  }

  /**
   * One unlogged batch: per candidate its INSERT and the DELETE of its key's lower candidates (as
   * the micro-batch writer sends them). Not atomic, which is harmless: each statement is an
   * idempotent upsert or delete, and a failed batch is sent again whole.
   */
  private BatchStatement statement(List<Candidate> group) {
    BatchStatementBuilder batch = BatchStatement.builder(BatchType.UNLOGGED);
    for (Candidate c : group) {
      Object[] values = values(c.view(), c.row());
      int[] at = deleteAts[c.view()];
      Object[] lower = new Object[at.length];
      for (int i = 0; i < lower.length; i++) {
        lower[i] = values[at[i]];
      }
      batch.addStatement(inserts[c.view()].bind(values));
      batch.addStatement(deletes[c.view()].bind(lower));
    }
    return batch.setConsistencyLevel(level).build();
  }

  private void send(List<Candidate> group, long deadline) {
    slots.acquireUninterruptibly();
    dispatch(group, deadline);
  }

  /**
   * Sends again each write that failed, after a pause (logged once a pause, as the micro-batch
   * writer does); fails the task on a permanent error.
   */
  private void retryFailed() {
    long delay = 500;
    Failed first;
    while ((first = failed.poll()) != null) {
      if (tooLarge(first.error) && first.group.size() > 1) {
        // Over the cluster's batch_size_fail_threshold: the same candidates in two requests.
        int half = (first.group.size() + 1) / 2;
        LOG.warn(
            "a batch of {} candidates was too large for the cluster; sending it in halves",
            first.group.size());
        send(first.group.subList(0, half), first.deadline);
        send(first.group.subList(half, first.group.size()), first.deadline);
        slots.acquireUninterruptibly(IN_FLIGHT);
        slots.release(IN_FLIGHT);
        continue;
      }
      if (permanent(first.error)) {
        throw new IllegalStateException(
            "Cassandra refused a candidate write: " + first.error.getMessage(), first.error);
      }
      if (System.currentTimeMillis() > first.deadline) {
        throw new IllegalStateException(
            "a candidate write still failed after " + giveUpAfterMs / 1000 + "s: " + first.error,
            first.error);
      }
      List<Failed> again = new ArrayList<>();
      again.add(first);
      Failed next;
      while ((next = failed.poll()) != null) {
        again.add(next);
      }
      if (lagsSchema(first.error)) {
        LOG.info(
            "{} candidate writes met a coordinator that has not seen the table yet; sending them again",
            again.size());
      } else {
        LOG.warn(
            "{} candidate writes to Cassandra failed ({}); retrying in {}s",
            again.size(),
            summary(first.error),
            delay / 1000.0);
      }
      try {
        TimeUnit.MILLISECONDS.sleep(delay);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw new IllegalStateException("interrupted while retrying a candidate write", e);
      }
      delay = Math.min(delay * 2, 10_000);
      for (Failed f : again) {
        send(f.group, f.deadline);
      }
      slots.acquireUninterruptibly(IN_FLIGHT);
      slots.release(IN_FLIGHT);
    }
  }

  /** A failure in one line: its class and the start of its message (the driver's are long). */
  static String summary(Throwable error) {
    String message = String.valueOf(error.getMessage()).replaceAll("\\s+", " ");
    if (message.length() > QUOTED) {
      message = message.substring(0, QUOTED) + "...";
    }
    return error.getClass().getSimpleName() + ": " + message;
  }

  /** Whether Cassandra refused a batch for its size (its {@code batch_size_fail_threshold}). */
  static boolean tooLarge(Throwable error) {
    return error instanceof InvalidQueryException
        && String.valueOf(error.getMessage()).toLowerCase(java.util.Locale.ROOT).contains("too large");
  }

  private boolean permanent(Throwable error) {
    if (lagsSchema(error)) {
      return false;
    }
    return error instanceof InvalidQueryException
        || error instanceof SyntaxError
        || error instanceof UnauthorizedException
        || error instanceof IllegalArgumentException
        || error instanceof ClassCastException;
  }

  /**
   * Whether a coordinator answered as if a table the cluster has did not exist: a node back from an
   * outage that has not pulled the schema of tables created meanwhile ("table X does not exist"), or
   * "Unknown CF". The driver's schema, from the other nodes, has the table: the write goes again,
   * and another node coordinates it (as lambdalake/cassandra/routing.py decides for Python).
   */
  boolean lagsSchema(Throwable error) {
    String message = String.valueOf(error.getMessage());
    if (error instanceof ServerError) {
      return message.contains("Unknown CF");
    }
    if (!(error instanceof InvalidQueryException)) {
      return false;
    }
    Matcher missing = MISSING_TABLE.matcher(message);
    if (!missing.find() || session == null) {
      return false;
    }
    String table = missing.group(1);
    return session.getMetadata().getKeyspaces().values().stream()
        .anyMatch(k -> k.getTable(CqlIdentifier.fromInternal(table)).isPresent());
  }

  /**
   * A row's value as the column's CQL type takes it. The query casts each column to the Spark type
   * of its CQL type first (lambdalake/spark/realtime.py), so only these pairs occur.
   */
  static Object value(Row row, int i, DataType type) {
    if (row.isNullAt(i)) {
      return null;
    }
    Object v = row.get(i);
    if (type.equals(DataTypes.BLOB)) {
      return ByteBuffer.wrap((byte[]) v);
    }
    if (type.equals(DataTypes.VARINT)) {
      return ((BigDecimal) v).toBigIntegerExact();
    }
    if (type.equals(DataTypes.TIMESTAMP)) {
      if (v instanceof java.sql.Timestamp t) {
        return t.toInstant();
      }
      return (Instant) v;
    }
    return v;
  }

  private record Failed(List<Candidate> group, Throwable error, long deadline) {}

  /** A view's key. */
  private record Slot(int view, List<Object> key) {}

  /**
   * A view's candidate: the row the query gave (converted only if it is written) and what ranks it.
   * Each row is an object of its own (Spark's Row deserializer makes one a record), so it can wait.
   */
  private record Candidate(int view, Row row, BigDecimal rank, int partition, long offset) {
    /** Whether this candidate outranks {@code other}: higher rank, then lower partition, offset. */
    boolean beats(Candidate other) {
      int byRank = rank.compareTo(other.rank);
      if (byRank != 0) {
        return byRank > 0;
      }
      if (partition != other.partition) {
        return partition < other.partition;
      }
      return offset < other.offset;
    }
  }
}
